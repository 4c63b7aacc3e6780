"""What the trainers compute from a rollout before their losses: the log-probs a ratio is taken
against, PPO's advantages and returns, the tokens a loss counts, the fields a loss needs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import rl
from .._core.errors import ConfigError
from .tokens import response_mask, right_pad

if TYPE_CHECKING:
    from .._core.flow.batch import Batch
    from .config import GRPO, PPO


def old_logprobs(
    g: GRPO, lp: torch.Tensor, rollout: torch.Tensor | None, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """The log-probs the ratio is taken against, the tokens' importance weights and what they
    say: with ``old_logprobs="recompute"`` the trainer's own (the weights before this step,
    which one step per batch leaves unchanged over its micro-batches), and the mean gap to the
    rollout's (``logprob_gap``: how far the engine's numbers are from the trainer's). A rollout
    without log-probs (None: an engine told not to compute them) leaves only the trainer's."""
    if g.old_logprobs == "rollout":
        return need_rollout(rollout, "GRPO.old_logprobs='rollout'"), None, {}
    old = lp.detach()
    if rollout is None:
        if g.tis_cap is not None:
            need_rollout(rollout, f"GRPO.tis_cap={g.tis_cap}")
        return old, None, {}
    valid = mask > 0
    gap = float((old - rollout).abs()[valid].mean()) if bool(valid.any()) else 0.0
    if g.tis_cap is None:
        return old, None, {"logprob_gap": gap}
    weights, stats = rl.tis_weights(old, rollout, mask, cap=g.tis_cap)
    return old, weights, {"logprob_gap": gap, **stats}


def need_rollout(rollout: torch.Tensor | None, why: str) -> torch.Tensor:
    if rollout is None:
        raise ConfigError(f"{why} needs the rollout's log-probs (field 'logprobs'), and the samples have none")
    return rollout


def ppo_targets(batch: Batch, ppo: PPO) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token advantages and returns (ragged): GAE over the KL-penalised rewards."""
    lengths = torch.tensor([len(r) for r in batch["response_ids"]])
    mask = with_loss_mask(batch, response_mask(lengths, int(lengths.max())))
    logp = right_pad(batch["logprobs"])
    ref = right_pad(need(batch, "ref_logprobs", "PPO.kl_coef > 0")) if ppo.kl_coef > 0 else logp
    values = right_pad(need(batch, "values", "PPO's advantages (GAE)"))
    rewards = rl.token_rewards(torch.as_tensor(batch["score"]).float(), logp, ref, mask, kl_coef=ppo.kl_coef, kl=ppo.kl)
    adv, returns = rl.gae(rewards, values, mask, gamma=ppo.gamma, lam=ppo.lam)
    cut = [int(n) for n in lengths]
    return [a[:n] for a, n in zip(adv, cut, strict=True)], [r[:n] for r, n in zip(returns, cut, strict=True)]


def with_loss_mask(batch: Batch, mask: torch.Tensor) -> torch.Tensor:
    """``mask`` less the response tokens the policy did not write: a multi-turn rollout's
    ``loss_mask`` (per sample, 1 for the policy's tokens, 0 for a tool's or an environment's
    inside the response) takes them out of every loss, KL term and token count."""
    if "loss_mask" not in batch:
        return mask
    kept = right_pad([torch.as_tensor(m) for m in batch["loss_mask"]])
    if kept.shape != mask.shape:
        lengths = [len(r) for r in batch["response_ids"]]
        raise ConfigError(
            f"field 'loss_mask' must hold one value per response token; responses have {lengths} tokens, "
            f"loss masks {[len(m) for m in batch['loss_mask']]}"
        )
    return mask * kept.to(mask)


def need(batch: Batch, field: str, why: str) -> Any:
    """``batch[field]``, or an error naming the model that writes it."""
    if field not in batch:
        writer = {"ref_logprobs": "an HFReference", "values": "an HFValue"}.get(field, "a model")
        raise ConfigError(
            f"the trainer needs field {field!r} for {why}; the rollout flow has no model writing it "
            f"(add {writer} to the flow), fields are {sorted(batch.keys())}"
        )
    return batch[field]
