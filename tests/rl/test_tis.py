"""Truncated importance sampling between an inference engine's log-probs and the trainer's:
the weights by hand, and a weighted policy loss whose gradient is the unweighted one scaled,
token by token, by the weight and nothing else."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flowrl import ConfigError
from flowrl.rl import policy_loss, tis_weights

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


def test_tis_weights_by_hand():
    old = f64([[-1.0, -2.0, -0.5], [-0.3, -4.0, 0.0]])
    rollout = f64([[-1.5, -1.0, -0.5], [-2.0, -4.1, -9.0]])
    mask = f64([[1, 1, 1], [1, 1, 0]])
    weights, stats = tis_weights(old, rollout, mask, cap=2.0)
    expected = f64([[math.exp(0.5), math.exp(-1.0), 1.0], [2.0, math.exp(0.1), 0.0]])  # exp(1.7) > 2: capped
    assert_close(weights, expected)
    assert stats["tis_mean"] == pytest.approx(float(expected.sum()) / 5)
    assert stats["tis_clip_fraction"] == pytest.approx(1 / 5)  # the padded position's huge ratio is not counted


@pytest.mark.parametrize("mode", MODES)
def test_weights_change_each_tokens_gradient_only_by_its_weight(mode):
    gen = torch.Generator().manual_seed(0)
    n, t = 4, 6
    logp = (-torch.rand(n, t, generator=gen, dtype=torch.float64)).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    rollout = old + 0.5 * torch.randn(n, t, generator=gen, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = (torch.rand(n, t, generator=gen) > 0.2).to(torch.float64)
    weights, _ = tis_weights(old, rollout, mask, cap=1.5)
    kwargs = {"clip": 0.2, "aggregation": mode}
    plain = torch.autograd.grad(policy_loss(logp, old, adv, mask, **kwargs)[0], logp)[0]
    weighted = torch.autograd.grad(policy_loss(logp, old, adv, mask, is_weights=weights, **kwargs)[0], logp)[0]
    assert_close(weighted, plain * weights)
    assert (weights < 1.5).any() and (weights == 1.5).any() and plain.abs().sum() > 0  # both branches, a real gradient


def test_weights_of_one_change_nothing_and_bad_input_is_named():
    logp, adv, mask = f64([[-1.0, -2.0]]), f64([1.0]), f64([[1, 1]])
    old = logp + 0.1
    assert_close(
        policy_loss(logp, old, adv, mask, is_weights=torch.ones(1, 2))[0], policy_loss(logp, old, adv, mask)[0]
    )
    with pytest.raises(ConfigError, match=r"policy_loss: is_weights"):
        policy_loss(logp, old, adv, mask, is_weights=torch.ones(2, 2))
    with pytest.raises(ConfigError, match=r"tis_weights: cap must be > 0"):
        tis_weights(logp, old, mask, cap=0.0)
    with pytest.raises(ConfigError, match=r"tis_weights: rollout_logprobs"):
        tis_weights(logp, f64([[1.0]]), mask)
