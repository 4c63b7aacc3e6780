"""Per-token losses over right-padded ``[n, T]`` tensors and the one place they are reduced.

Every loss is first computed per token, then reduced by :func:`aggregate`. The reduction takes
the normalisers (token count, sequence count, padded length) as arguments so that a trainer that
splits a global batch into micro-batches and data-parallel ranks can pass the counts of the whole
global batch: the sum of the micro-batch losses (and of their gradients over ranks) is then the
loss of the global batch, whatever the split.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from .._core.errors import ConfigError
from ._checks import any_tensor, choice, floats, mask_like, number, positive, same_shape

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""How per-token values become one scalar; see :func:`aggregate`."""

KLKind = Literal["k1", "k2", "k3", "abs"]
"""Per-token estimators of KL(policy || reference); see :func:`kl_estimate`."""

AGGREGATIONS: tuple[str, ...] = get_args(Aggregation)
KL_KINDS: tuple[str, ...] = get_args(KLKind)


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probabilities.

    ``logprobs`` are the log-probabilities of the sampled tokens under the policy (the tokens were
    drawn from it), ``ref_logprobs`` those under the reference model; both have the same shape and
    the result has it too. With ``d = logprobs - ref_logprobs``:

    - ``"k1"``: ``d``, unbiased but of either sign;
    - ``"k2"``: ``d**2 / 2``, biased, non-negative, low variance;
    - ``"k3"``: ``exp(-d) + d - 1``, unbiased and non-negative;
    - ``"abs"``: ``|d|``.
    """
    fn = "kl_estimate"
    policy = any_tensor(fn, "logprobs", logprobs)
    ref = same_shape(fn, "ref_logprobs", ref_logprobs, policy, "logprobs")
    choice(fn, "kind", kind, KL_KINDS)
    log_ratio = policy - ref
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    return log_ratio.abs()


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    *,
    num_tokens: int | None = None,
    num_sequences: int | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Reduce ``per_token`` ``[n, T]`` over its valid tokens (``mask`` 1) to a scalar.

    Modes, with ``s_i`` the sum of row ``i``'s valid values and ``l_i`` its valid-token count:

    - ``"token-mean"``: ``sum_i s_i / num_tokens``;
    - ``"seq-mean-token-mean"``: ``sum_i (s_i / l_i) / num_sequences``;
    - ``"seq-mean-token-sum"``: ``sum_i s_i / num_sequences``;
    - ``"seq-mean-token-sum-norm"``: ``sum_i s_i / (num_sequences * max_tokens)``, a constant
      normaliser that weighs every token alike whatever its sequence's length (Dr. GRPO).

    The counts describe the WHOLE global batch (every micro-batch on every data-parallel rank):
    ``num_tokens`` its number of valid tokens, ``num_sequences`` its number of rows with at least
    one valid token, ``max_tokens`` the length budget (e.g. the maximum response length). Each
    term above is then a sum over rows divided by a constant, so summing this function's results
    over micro-batches, and gradients over ranks, gives exactly the global-batch value (DDP and
    FSDP average gradients over ranks rather than sum them: scale the loss by the world size to
    undo that). Rows must not be split across micro-batches. A count
    left ``None`` is taken from this tensor (``max_tokens`` from its padded width ``T``), which is
    a plain mean over this tensor alone. Values at padded positions are ignored.
    """
    fn = "aggregate"
    values = floats(fn, "per_token", per_token, 2)
    weights = mask_like(fn, mask, values, "per_token")
    _check_reduction(fn, "mode", mode, (num_tokens, num_sequences, max_tokens))
    valid = weights > 0
    masked = torch.where(valid, values, values.new_zeros(()))
    if mode == "token-mean":
        return masked.sum() / _count(num_tokens, valid.sum())
    sequences = _count(num_sequences, valid.any(dim=1).sum())
    if mode == "seq-mean-token-mean":
        lengths = valid.sum(dim=1).clamp(min=1)
        return (masked.sum(dim=1) / lengths).sum() / sequences
    if mode == "seq-mean-token-sum":
        return masked.sum() / sequences
    width = values.shape[1] if max_tokens is None else max_tokens
    return masked.sum() / (sequences * width)


def _check_reduction(fn: str, name: str, mode: str, counts: tuple[int | None, int | None, int | None]) -> None:
    """Check an aggregation mode and its counts up front, so errors name the caller's arguments."""
    choice(fn, name, mode, AGGREGATIONS)
    for count_name, count in zip(("num_tokens", "num_sequences", "max_tokens"), counts, strict=True):
        positive(fn, count_name, count)


def _count(given: int | None, local: torch.Tensor) -> int | torch.Tensor:
    # an all-padding tensor reduces to 0 rather than 0/0
    return given if given is not None else local.clamp(min=1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token-mean",
    num_tokens: int | None = None,
    num_sequences: int | None = None,
    max_tokens: int | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate, as a loss to minimise, and statistics of the update.

    With ``r = exp(logprobs - old_logprobs)`` and advantage ``A`` per token, the per-token loss
    is ``max(-A * r, -A * clamp(r, 1 - clip, 1 + clip_high))``; ``clip_high`` (default ``clip``)
    widens the upper bound only (DAPO's clip-higher). With ``dual_clip = c > 1``, the loss of a
    token with ``A < 0`` is further capped at ``-c * A``: however large ``r`` grows, such a token
    contributes at most ``c * |A|`` and, once capped, no gradient (dual-clip PPO). ``advantages``
    is ``[n, T]`` or per sample ``[n]`` (broadcast over tokens); it and ``old_logprobs`` are
    treated as constants. ``is_weights`` (``[n, T]``, constants; e.g. :func:`tis_weights`)
    multiply each token's loss, and so its gradient, before the reduction. The loss is reduced
    by :func:`aggregate` with ``aggregation`` and the given counts.

    ``stats`` (floats, detached, token means over this tensor's valid tokens): ``clip_fraction``
    (share of tokens on the clipped branch, whose gradient is zero), ``dual_clip_fraction``
    (share capped by the dual clip), ``ratio_mean``, and ``approx_kl``, the non-negative unbiased
    estimate ``r - 1 - log r`` of KL(old policy || policy) from tokens sampled by the old policy.
    """
    fn = "policy_loss"
    logp = floats(fn, "logprobs", logprobs, 2)
    old = same_shape(fn, "old_logprobs", old_logprobs, logp, "logprobs").detach()
    adv = _token_advantages(fn, advantages, logp)
    weights = mask_like(fn, mask, logp, "logprobs")
    positive(fn, "clip", number(fn, "clip", clip))  # required: None is not "no clip" here
    positive(fn, "clip_high", clip_high)
    positive(fn, "dual_clip", dual_clip, above=1.0)
    _check_reduction(fn, "aggregation", aggregation, (num_tokens, num_sequences, max_tokens))
    high = clip if clip_high is None else clip_high
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip, 1 + high)
    per_token = torch.maximum(unclipped, clipped)
    capped = per_token
    if dual_clip is not None:
        capped = torch.where(adv < 0, torch.minimum(per_token, -dual_clip * adv), per_token)
    dual = capped < per_token  # before the weights, which scale every branch alike
    if is_weights is not None:
        capped = capped * same_shape(fn, "is_weights", is_weights, logp, "logprobs").detach().to(logp.dtype)
    loss = aggregate(
        capped, weights, aggregation, num_tokens=num_tokens, num_sequences=num_sequences, max_tokens=max_tokens
    )
    shares = {
        "clip_fraction": clipped > unclipped,
        "dual_clip_fraction": dual,
        "ratio_mean": ratio,
        "approx_kl": ratio - 1 - log_ratio,
    }
    return loss, _token_means(shares, weights)


def tis_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, *, cap: float = 2.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance-sampling weights for tokens sampled by an inference engine whose
    numbers differ from the trainer's: ``min(exp(old_logprobs - rollout_logprobs), cap)`` per
    token, where ``old_logprobs`` are the sampled tokens' log-probabilities recomputed by the
    trainer's weights that generated them and ``rollout_logprobs`` the engine's own. Pass them as
    ``policy_loss(..., is_weights=)``: each token's gradient is scaled by its weight, so that the
    update follows the trainer's distribution rather than the engine's; the cap bounds the
    variance. Detached; 0 at padded positions.

    ``stats``: ``tis_mean`` (the mean weight over valid tokens) and ``tis_clip_fraction`` (the
    share of valid tokens whose ratio exceeded ``cap``)."""
    fn = "tis_weights"
    old = floats(fn, "old_logprobs", old_logprobs, 2).detach()
    rollout = same_shape(fn, "rollout_logprobs", rollout_logprobs, old, "old_logprobs").detach()
    valid = mask_like(fn, mask, old, "old_logprobs") > 0
    positive(fn, "cap", number(fn, "cap", cap))
    ratio = torch.exp(torch.where(valid, old - rollout, 0.0))
    out = torch.where(valid, ratio.clamp(max=cap), 0.0)
    return out, _token_means({"tis_mean": out, "tis_clip_fraction": ratio > cap}, valid.to(old.dtype))


def _token_advantages(fn: str, advantages: object, logp: torch.Tensor) -> torch.Tensor:
    """Per-token advantages ``[n, T]`` from ``[n, T]`` or per-sample ``[n]`` input, detached."""
    if isinstance(advantages, torch.Tensor) and advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise ConfigError(
                f"{fn}: advantages must have shape [n] or [n, T] with n = {logp.shape[0]} (the rows of logprobs), "
                f"got {tuple(advantages.shape)}"
            )
        advantages = advantages[:, None].expand_as(logp)
    checked = same_shape(fn, "advantages", advantages, logp, "logprobs")
    return checked.detach().to(logp.dtype)


def _token_means(values: dict[str, torch.Tensor], weights: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        valid = weights > 0
        count = valid.sum().clamp(min=1)
        means = [torch.where(valid, v.to(weights.dtype), 0).sum() / count for v in values.values()]
        return dict(zip(values, torch.stack(means).tolist(), strict=True))


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    kind: KLKind = "k3",
    aggregation: Aggregation = "token-mean",
    num_tokens: int | None = None,
    num_sequences: int | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """KL(policy || reference) as a loss term (GRPO puts it in the loss rather than the reward).

    The per-token :func:`kl_estimate` of ``kind`` reduced by :func:`aggregate`; gradients flow to
    ``logprobs`` only (the reference is a constant). Multiply by the KL coefficient yourself.
    """
    fn = "kl_loss"
    policy = floats(fn, "logprobs", logprobs, 2)
    ref = same_shape(fn, "ref_logprobs", ref_logprobs, policy, "logprobs").detach()
    weights = mask_like(fn, mask, policy, "logprobs")
    choice(fn, "kind", kind, KL_KINDS)
    _check_reduction(fn, "aggregation", aggregation, (num_tokens, num_sequences, max_tokens))
    per_token = kl_estimate(policy, ref, kind)
    return aggregate(
        per_token, weights, aggregation, num_tokens=num_tokens, num_sequences=num_sequences, max_tokens=max_tokens
    )


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
    aggregation: Aggregation = "token-mean",
    num_tokens: int | None = None,
    num_sequences: int | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Half the squared error of ``values`` against ``returns``, reduced by :func:`aggregate`.

    With ``clip``, PPO's value clipping: the prediction is also taken as
    ``old_values + clamp(values - old_values, -clip, clip)`` and each token keeps the larger of
    the two errors, so a value moved more than ``clip`` away from ``old_values`` in the direction
    of its target gets no further push. ``old_values`` and ``returns`` are constants.
    """
    fn = "value_loss"
    pred = floats(fn, "values", values, 2)
    old = same_shape(fn, "old_values", old_values, pred, "values").detach()
    target = same_shape(fn, "returns", returns, pred, "values").detach()
    weights = mask_like(fn, mask, pred, "values")
    positive(fn, "clip", clip)
    _check_reduction(fn, "aggregation", aggregation, (num_tokens, num_sequences, max_tokens))
    error = (pred - target).square()
    if clip is not None:
        moved = old + (pred - old).clamp(-clip, clip)
        error = torch.maximum(error, (moved - target).square())
    return aggregate(
        0.5 * error, weights, aggregation, num_tokens=num_tokens, num_sequences=num_sequences, max_tokens=max_tokens
    )


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the softmax over the last dimension: ``[..., V]`` -> ``[...]``.

    Computed as ``logsumexp(z) - sum(softmax(z) * z)``, which stays finite, with finite
    gradients, when some logits are ``-inf`` (tokens masked out of the vocabulary).
    """
    fn = "entropy_from_logits"
    z = any_tensor(fn, "logits", logits)
    if z.dim() == 0:
        raise ConfigError(f"{fn}: logits must have a vocabulary dimension [..., V], got a 0-d tensor")
    if not z.is_floating_point():
        raise ConfigError(f"{fn}: logits must be a floating-point tensor, got dtype {z.dtype}")
    finite = z.masked_fill(torch.isneginf(z), 0.0)
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * finite).sum(dim=-1)
