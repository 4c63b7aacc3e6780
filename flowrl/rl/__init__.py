"""RL losses and advantage estimators over padded token tensors with masks.

Pure functions of torch tensors, usable without Ray or any other part of flowrl. Token tensors
are ``[n, T]`` (one row per sample, right-padded) with a 0/1 ``mask`` of the same shape; scores
and per-sample advantages are ``[n]``.

- advantages: :func:`group_advantages` (GRPO, Dr. GRPO), :func:`rloo_advantages`,
  :func:`reinforce_advantages` (REINFORCE, REINFORCE++), :func:`token_rewards` and :func:`gae`
  (PPO), :func:`expand_to_tokens`;
- losses: :func:`policy_loss` (PPO clip, clip-higher, dual clip; per-token importance weights
  such as :func:`tis_weights`, the truncated correction between an inference engine's
  log-probs and the trainer's), :func:`kl_loss`,
  :func:`value_loss`, :func:`kl_estimate`, :func:`entropy_from_logits`, all reduced by
  :func:`aggregate`;
- sampling: :func:`sample_rows` (a token per row, each row from its sample's own generator,
  ``Batch.generators``).

The reductions take the token and sequence counts of the whole global batch as arguments: a
trainer that sums the losses of its micro-batches, and the gradients over its data-parallel
ranks, then computes exactly the global-batch loss and gradient, however the batch was split.
"""

from __future__ import annotations

from .advantages import (
    Baseline,
    GroupScale,
    expand_to_tokens,
    gae,
    group_advantages,
    reinforce_advantages,
    rloo_advantages,
    token_rewards,
)
from .losses import (
    Aggregation,
    KLKind,
    aggregate,
    entropy_from_logits,
    kl_estimate,
    kl_loss,
    policy_loss,
    tis_weights,
    value_loss,
)
from .sampling import sample_rows

__all__ = [
    "Aggregation",
    "Baseline",
    "GroupScale",
    "KLKind",
    "aggregate",
    "entropy_from_logits",
    "expand_to_tokens",
    "gae",
    "group_advantages",
    "kl_estimate",
    "kl_loss",
    "policy_loss",
    "reinforce_advantages",
    "rloo_advantages",
    "sample_rows",
    "tis_weights",
    "token_rewards",
    "value_loss",
]
