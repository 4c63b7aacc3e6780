"""Advantage estimators: per-sample (GRPO, RLOO, REINFORCE) and per-token (rewards with a KL
penalty, GAE).

Scores are one float per sample ``[n]``; token tensors are ``[n, T]`` with a 0/1 ``mask`` of the
same shape (rows right-padded). Estimators return targets, not differentiable quantities: use
their outputs as constants in the losses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

import torch

from .._core.errors import ConfigError
from ._checks import any_tensor, choice, floats, mask_like, number, positive, same_shape
from .losses import KL_KINDS, KLKind, kl_estimate

if TYPE_CHECKING:
    from collections.abc import Sequence

GroupScale = Literal["std", "none"]
"""How :func:`group_advantages` scales a centred score."""

Baseline = Literal["none", "batch-mean"]
"""What :func:`reinforce_advantages` subtracts from a score."""

GROUP_SCALES: tuple[str, ...] = get_args(GroupScale)
BASELINES: tuple[str, ...] = get_args(Baseline)


def group_advantages(
    scores: torch.Tensor,
    groups: torch.Tensor | Sequence[int],
    *,
    scale: GroupScale = "std",
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO's advantage: each score minus the mean score of its group, per sample ``[n]``.

    ``groups`` gives each sample's group key (an int, e.g. its prompt's index); samples of one
    group need not be adjacent. With ``scale="std"`` the centred score is divided by
    ``std + eps``, where ``std`` is the group's sample standard deviation with Bessel's correction
    (divisor ``k - 1`` for ``k`` samples, as ``torch.std`` does by default). ``scale="none"``
    keeps the centred score (Dr. GRPO). A group of one sample gets advantage 0.
    """
    fn = "group_advantages"
    values = floats(fn, "scores", scores, 1)
    choice(fn, "scale", scale, GROUP_SCALES)
    positive(fn, "eps", eps)
    inverse, counts = _group_index(fn, groups, values)
    sizes = counts[inverse]
    means = _group_sums(values, inverse, counts) / counts
    centred = values - means[inverse]
    if scale == "std":
        squares = _group_sums(centred.square(), inverse, counts)
        std = (squares / (counts - 1).clamp(min=1)).sqrt()
        centred = centred / (std[inverse] + eps)
    return torch.where(sizes > 1, centred, 0.0)


def rloo_advantages(scores: torch.Tensor, groups: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """REINFORCE leave-one-out: each score minus the mean of the OTHER scores of its group.

    The baseline of a sample does not depend on the sample itself, which keeps the policy
    gradient unbiased. ``groups`` as in :func:`group_advantages`; a group of one sample gets 0.
    """
    fn = "rloo_advantages"
    values = floats(fn, "scores", scores, 1)
    inverse, counts = _group_index(fn, groups, values)
    sizes = counts[inverse]
    others = _group_sums(values, inverse, counts)[inverse] - values
    advantages = values - others / (sizes - 1).clamp(min=1)
    return torch.where(sizes > 1, advantages, 0.0)


def reinforce_advantages(
    scores: torch.Tensor,
    *,
    baseline: Baseline = "none",
    whiten: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE advantages from per-sample scores ``[n]``, normalised over this batch.

    ``baseline="batch-mean"`` subtracts the batch's mean score. ``whiten`` then divides by the
    batch's standard deviation (Bessel-corrected) plus ``eps``; with both, the advantages have
    mean 0 and standard deviation 1 over the batch (REINFORCE++). The statistics are those of
    this tensor: pass the whole global batch to normalise over it.
    """
    fn = "reinforce_advantages"
    values = floats(fn, "scores", scores, 1)
    choice(fn, "baseline", baseline, BASELINES)
    positive(fn, "eps", eps)
    if whiten and values.shape[0] < 2:
        raise ConfigError(f"{fn}: whiten=True needs at least 2 scores to estimate a std, got {values.shape[0]}")
    result = values - values.mean() if baseline == "batch-mean" else values.clone()
    if whiten:
        result = result / (values.std() + eps)
    return result


def token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coef: float,
    kl: KLKind = "k1",
) -> torch.Tensor:
    """Per-token rewards ``[n, T]`` for PPO: a KL penalty on every token, the score at the end.

    Each valid token gets ``-kl_coef * kl_estimate(logprobs, ref_logprobs, kl)``; the last valid
    token of each row (the largest index with mask 1) also gets the row's score. Padded positions
    get 0. Every row needs at least one valid token, or its score would be lost.
    """
    fn = "token_rewards"
    policy = floats(fn, "logprobs", logprobs, 2)
    ref = same_shape(fn, "ref_logprobs", ref_logprobs, policy, "logprobs")
    weights = mask_like(fn, mask, policy, "logprobs")
    values = floats(fn, "scores", scores, 1)
    if values.shape[0] != policy.shape[0]:
        raise ConfigError(
            f"{fn}: scores must have one value per row of logprobs ({policy.shape[0]}), got {values.shape[0]}"
        )
    choice(fn, "kl", kl, KL_KINDS)
    valid = weights > 0
    empty = (~valid.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ConfigError(f"{fn}: every row of mask needs at least one valid token, rows {empty} have none")
    penalty = -number(fn, "kl_coef", kl_coef) * kl_estimate(policy, ref, kl)
    rewards = torch.where(valid, penalty, 0.0)
    positions = torch.arange(policy.shape[1], device=policy.device).expand_as(valid)
    last = torch.where(valid, positions, -1).argmax(dim=1)
    rows = torch.arange(policy.shape[0], device=policy.device)
    return rewards.index_put((rows, last), values.to(rewards.dtype), accumulate=True)


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation per token: ``(advantages, returns)``, both ``[n, T]``.

    ``A_t = sum_k (gamma * lam)**k * delta_{t+k}`` with ``delta_t = r_t + gamma * V_next - V_t``,
    where ``V_next`` is the value of the next valid token of the row and 0 after the last one
    (the episode ends there). Masked positions are skipped, so holes inside a row (e.g. tool
    output in a multi-turn response) do not break the recursion, and get 0, as do pads;
    ``returns = advantages + values`` on valid tokens. The outputs are detached: they are targets.
    """
    fn = "gae"
    r = floats(fn, "rewards", rewards, 2).detach()
    v = same_shape(fn, "values", values, r, "rewards").detach().to(r.dtype)
    weights = mask_like(fn, mask, r, "rewards")
    _unit_interval(fn, "gamma", gamma)
    _unit_interval(fn, "lam", lam)
    valid = weights > 0
    advantages = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    next_value = r.new_zeros(r.shape[0])
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        here = valid[:, t]
        running = torch.where(here, delta + gamma * lam * running, running)
        next_value = torch.where(here, v[:, t], next_value)
        advantages[:, t] = torch.where(here, running, 0.0)
    returns = torch.where(valid, advantages + v, 0.0)
    return advantages, returns


def expand_to_tokens(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sample value ``[n]`` onto the valid tokens of ``mask`` ``[n, T]`` (0 on pads)."""
    fn = "expand_to_tokens"
    values = floats(fn, "per_sample", per_sample, 1)
    if any_tensor(fn, "mask", mask).dim() != 2 or mask.shape[0] != values.shape[0]:
        raise ConfigError(
            f"{fn}: mask must have shape [n, T] with n = {values.shape[0]} (the length of per_sample), "
            f"got {tuple(mask.shape)}"
        )
    return torch.where(mask > 0, values[:, None], 0.0)


def _group_index(
    fn: str, groups: torch.Tensor | Sequence[int], values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's dense group index, and each group's size (as ``values``' dtype)."""
    try:
        keys = torch.as_tensor(groups, device=values.device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ConfigError(f"{fn}: groups must be a tensor or sequence of int group keys, got {groups!r}") from err
    if keys.dim() != 1 or keys.shape[0] != values.shape[0]:
        raise ConfigError(
            f"{fn}: groups must hold one group key per score ({values.shape[0]}), got shape {tuple(keys.shape)}"
        )
    if keys.is_floating_point() or keys.is_complex():
        raise ConfigError(f"{fn}: groups must hold integer keys, got dtype {keys.dtype}")
    unique, inverse = torch.unique(keys, return_inverse=True)
    counts = values.new_zeros(unique.shape[0]).index_add(0, inverse, torch.ones_like(values))
    return inverse, counts


def _group_sums(values: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-group sums of ``values``, one per entry of ``counts``."""
    return values.new_zeros(counts.shape[0]).index_add(0, inverse, values)


def _unit_interval(fn: str, name: str, value: float) -> None:
    if not 0.0 <= number(fn, name, value) <= 1.0:
        raise ConfigError(f"{fn}: {name} must be in [0, 1], got {value!r}")
