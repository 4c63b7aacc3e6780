"""Losses and their reduction against hand computations; micro-batch and data-parallel exactness."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flowrl import ConfigError
from flowrl.rl import aggregate, entropy_from_logits, kl_estimate, kl_loss, policy_loss, value_loss

MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize(
    ("kind", "formula"),
    [
        ("k1", lambda d: d),
        ("k2", lambda d: d * d / 2),
        ("k3", lambda d: math.exp(-d) + d - 1),
        ("abs", abs),
    ],
)
def test_kl_estimate_of_policy_against_reference(kind, formula):
    logprobs = [-1.0, -2.0, -0.5, -3.0]
    ref_logprobs = [-1.5, -1.0, -0.5, -1.0]  # d = logprobs - ref_logprobs = 0.5, -1, 0, -2
    expected = [formula(p - q) for p, q in zip(logprobs, ref_logprobs, strict=True)]
    assert_close(kl_estimate(f64(logprobs), f64(ref_logprobs), kind), f64(expected))


# rows: 3 valid tokens, 2 valid tokens, none (a filtered-out sequence); pads hold NaN
VALUES = [[1.0, 2.0, 3.0, math.nan], [5.0, 6.0, math.nan, math.nan], [math.nan] * 4]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "counts", "expected"),
    [
        # valid sum 1+2+3+5+6 = 17 over 5 tokens; row sums 6, 11; row means 2, 5.5; 2 non-empty rows; T = 4
        ("token-mean", {}, 17 / 5),
        ("seq-mean-token-mean", {}, (2 + 5.5) / 2),
        ("seq-mean-token-sum", {}, (6 + 11) / 2),
        ("seq-mean-token-sum-norm", {}, 17 / (2 * 4)),
        ("token-mean", {"num_tokens": 10}, 17 / 10),
        ("seq-mean-token-mean", {"num_sequences": 4}, (2 + 5.5) / 4),
        ("seq-mean-token-sum", {"num_sequences": 4}, (6 + 11) / 4),
        ("seq-mean-token-sum-norm", {"num_sequences": 4, "max_tokens": 8}, 17 / (4 * 8)),
    ],
)
def test_aggregate_by_hand(mode, counts, expected):
    result = aggregate(f64(VALUES), torch.tensor(MASK), mode, **counts)
    assert result.dim() == 0
    assert_close(result, f64(expected))


def test_aggregate_of_only_padding_is_zero():
    assert_close(aggregate(f64([[1.0, 2.0]]), torch.tensor([[0, 0]]), "token-mean"), f64(0.0))


def _random_batch(rows=7, width=5):
    gen = torch.Generator().manual_seed(1234)
    values = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    lengths = [5, 1, 3, 0, 2, 4, 5]  # one row with no valid token
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    return values, mask


def _global_counts(mask):
    return {
        "num_tokens": int(mask.sum()),
        "num_sequences": int((mask.sum(dim=1) > 0).sum()),
        "max_tokens": mask.shape[1],
    }


@pytest.mark.parametrize("mode", MODES)
def test_summing_micro_batches_on_all_ranks_with_global_counts_gives_the_global_aggregate(mode):
    values, mask = _random_batch()
    counts = _global_counts(mask)
    whole = values.clone().requires_grad_()
    aggregate(whole, mask, mode, **counts).backward()
    # two data-parallel ranks of 3 and 4 rows, each cut into uneven micro-batches; every
    # micro-batch is cut back to its own padded width, as a collator would
    parts = [(0, 2), (2, 3), (3, 4), (4, 7)]
    leaf = values.clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for start, stop in parts:
        micro_mask = mask[start:stop]
        width = max(int(micro_mask.sum(dim=1).max()), 1)
        total = total + aggregate(leaf[start:stop, :width], micro_mask[:, :width], mode, **counts)
    total.backward()
    assert_close(total, aggregate(values, mask, mode, **counts))
    assert_close(leaf.grad, whole.grad)  # the gradient summed over micro-batches and ranks


@pytest.mark.parametrize("mode", MODES)
def test_without_counts_the_aggregate_is_a_plain_mean_over_this_tensor(mode):
    values, mask = _random_batch()
    rows = [values[i, : int(mask[i].sum())].tolist() for i in range(values.shape[0])]
    kept = [row for row in rows if row]
    flat = [x for row in kept for x in row]
    expected = {
        "token-mean": sum(flat) / len(flat),
        "seq-mean-token-mean": sum(sum(row) / len(row) for row in kept) / len(kept),
        "seq-mean-token-sum": sum(flat) / len(kept),
        "seq-mean-token-sum-norm": sum(flat) / (len(kept) * values.shape[1]),
    }[mode]
    assert_close(aggregate(values, mask, mode), f64(expected))


# PPO case: ratios per valid token, per-sample advantages +1 and -2, clip 0.2
RATIOS = [[1.5, 0.5, 1.1, 50.0], [0.7, 1.3, 50.0, 50.0]]
LOGP = [[-1.0, -2.0, -0.5, -0.1], [-0.3, -0.7, -0.2, -0.4]]
PPO_MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]


def _ppo_inputs(ratios=RATIOS, logp=LOGP):
    logprobs = f64(logp).requires_grad_()
    old = f64(logp) - torch.log(f64(ratios))
    return logprobs, old


def test_policy_loss_clipped_surrogate_stats_and_gradient_by_hand():
    logprobs, old = _ppo_inputs()
    loss, stats = policy_loss(logprobs, old, f64([1.0, -2.0]), torch.tensor(PPO_MASK))
    # A=+1: r=1.5 -> clipped to 1.2, loss -1.2 (no gradient); r=0.5 -> -0.5; r=1.1 -> -1.1
    # A=-2: r=0.7 -> clipped to 0.8, loss 1.6 (no gradient); r=1.3 -> 2.6 (the unclipped term is larger)
    assert_close(loss, f64((-1.2 - 0.5 - 1.1 + 1.6 + 2.6) / 5))
    loss.backward()
    # d(-A r / 5)/d logp = -A r / 5 on the unclipped tokens
    assert_close(logprobs.grad, f64([[0.0, -0.5 / 5, -1.1 / 5, 0.0], [0.0, 2 * 1.3 / 5, 0.0, 0.0]]))
    valid = [1.5, 0.5, 1.1, 0.7, 1.3]
    assert stats.keys() == {"clip_fraction", "dual_clip_fraction", "ratio_mean", "approx_kl"}
    assert stats["clip_fraction"] == pytest.approx(2 / 5)
    assert stats["dual_clip_fraction"] == 0.0
    assert stats["ratio_mean"] == pytest.approx(sum(valid) / 5)
    assert stats["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in valid) / 5)
    assert all(type(v) is float for v in stats.values())


def test_policy_loss_clip_higher_raises_only_the_upper_bound():
    logprobs, old = _ppo_inputs()
    loss, stats = policy_loss(logprobs, old, f64([1.0, -2.0]), torch.tensor(PPO_MASK), clip_high=0.28)
    # r=1.5 with A=+1 is now clipped at 1.28; r=0.7 with A=-2 still at 0.8
    assert_close(loss, f64((-1.28 - 0.5 - 1.1 + 1.6 + 2.6) / 5))
    assert stats["clip_fraction"] == pytest.approx(2 / 5)


def test_policy_loss_seq_mean_token_mean_by_hand():
    logprobs, old = _ppo_inputs()
    loss, _ = policy_loss(logprobs, old, f64([1.0, -2.0]), torch.tensor(PPO_MASK), aggregation="seq-mean-token-mean")
    assert_close(loss, f64(((-1.2 - 0.5 - 1.1) / 3 + (1.6 + 2.6) / 2) / 2))


def test_dual_clip_caps_the_loss_of_negative_advantages():
    logprobs, old = _ppo_inputs(ratios=[[4.0, 2.5, 0.5]], logp=[[-1.0, -2.0, -3.0]])
    advantages = f64([[-2.0, -2.0, -2.0]])  # per token this time
    loss, stats = policy_loss(logprobs, old, advantages, torch.ones(1, 3), dual_clip=3.0)
    # r=4: PPO loss 2 * 4 = 8, capped at 3 * 2 = 6 (no gradient); r=2.5: 5 < 6, kept;
    # r=0.5: clipped to 0.8, loss 1.6 (no gradient)
    assert_close(loss, f64((6.0 + 5.0 + 1.6) / 3))
    loss.backward()
    assert_close(logprobs.grad, f64([[0.0, 2 * 2.5 / 3, 0.0]]))
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 3)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)


def test_dual_clip_leaves_positive_advantages_alone():
    logprobs, old = _ppo_inputs(ratios=[[4.0]], logp=[[-1.0]])
    loss, stats = policy_loss(logprobs, old, f64([2.0]), torch.ones(1, 1), dual_clip=3.0)
    assert_close(loss, f64(-2.0 * 1.2))
    assert stats["dual_clip_fraction"] == 0.0


def test_per_sample_advantages_equal_their_per_token_broadcast_and_are_constants():
    logprobs, old = _ppo_inputs()
    old.requires_grad_()
    advantages = f64([1.0, -2.0]).requires_grad_()
    per_token = f64([[1.0, 1.0, 1.0, 7.0], [-2.0, -2.0, 7.0, 7.0]])
    mask = torch.tensor(PPO_MASK)
    loss_a, stats_a = policy_loss(logprobs, old, advantages, mask)
    loss_b, stats_b = policy_loss(logprobs, old, per_token, mask)
    assert_close(loss_a, loss_b)
    assert stats_a == stats_b
    loss_a.backward()
    assert advantages.grad is None and old.grad is None


def test_kl_loss_k3_value_and_gradient_by_hand():
    logprobs = f64([[-1.0, -2.0, 0.3], [-0.5, 0.0, 0.0]]).requires_grad_()
    ref = f64([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss = kl_loss(logprobs, ref, mask)
    d = [0.5, -1.0, 0.0]  # the valid tokens' log ratios
    assert_close(loss, f64(sum(math.exp(-x) + x - 1 for x in d) / 3))
    loss.backward()
    # d/dlogp (exp(-d) + d - 1) = 1 - exp(-d)
    expected = [[(1 - math.exp(-0.5)) / 3, (1 - math.exp(1.0)) / 3, 0.0], [0.0, 0.0, 0.0]]
    assert_close(logprobs.grad, f64(expected))


def test_kl_loss_k1_with_sequence_aggregation():
    logprobs = f64([[-1.0, -2.0, 0.3], [-0.5, 0.0, 0.0]])
    ref = f64([[-1.5, -1.0, 0.0], [-0.1, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss = kl_loss(logprobs, ref, mask, kind="k1", aggregation="seq-mean-token-sum", num_sequences=4)
    assert_close(loss, f64((0.5 - 1.0 - 0.4) / 4))


# values, old values and returns on 3 valid tokens and one pad
V = [[1.0, 2.0, 3.0, 9.0]]
OLD_V = [[1.5, 1.0, 3.0, 0.0]]
RETURNS = [[2.0, 2.5, 2.5, 0.0]]
V_MASK = [[1, 1, 1, 0]]


def test_value_loss_without_clip():
    values = f64(V).requires_grad_()
    loss = value_loss(values, f64(OLD_V), f64(RETURNS), torch.tensor(V_MASK))
    assert_close(loss, f64((0.5 * 1.0 + 0.5 * 0.25 + 0.5 * 0.25) / 3))
    loss.backward()
    assert_close(values.grad, f64([[-1.0 / 3, -0.5 / 3, 0.5 / 3, 0.0]]))


def test_value_loss_with_clip_keeps_the_larger_error():
    values = f64(V).requires_grad_()
    loss = value_loss(values, f64(OLD_V), f64(RETURNS), torch.tensor(V_MASK), clip=0.2)
    # t0: moved 1.5 -> 1.3, error 0.7**2 < 1**2: unclipped 0.5 kept (gradient v - R = -1)
    # t1: moved 1.0 -> 1.2, error 1.3**2 > 0.5**2: clipped 0.845 kept (no gradient)
    # t2: unchanged, 0.125 either way (gradient v - R = 0.5)
    assert_close(loss, f64((0.5 + 0.845 + 0.125) / 3))
    loss.backward()
    assert_close(values.grad, f64([[-1.0 / 3, 0.0, 0.5 / 3, 0.0]]))


def test_entropy_from_logits_by_hand():
    logits = f64([[[0.0, 0.0, -math.inf], [0.0, math.log(3.0), -math.inf]], [[5.0, 5.0, 5.0], [0.0, 0.0, 0.0]]])
    logits.requires_grad_()
    entropy = entropy_from_logits(logits)
    quarter = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # probabilities 1/4, 3/4
    assert_close(entropy, f64([[math.log(2.0), quarter], [math.log(3.0), math.log(3.0)]]))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: aggregate(f64(VALUES), torch.tensor(MASK), "foo"), ["aggregate: mode", "'token-mean'", "'foo'"]),
        (lambda: aggregate(f64(VALUES), torch.ones(3, 5), "token-mean"), ["mask", "(3, 4)", "(3, 5)"]),
        (lambda: aggregate(f64([1.0]), torch.ones(1), "token-mean"), ["per_token", "2 dimension"]),
        (lambda: aggregate(f64(VALUES), torch.tensor(MASK), "token-mean", num_tokens=0), ["num_tokens", "> 0"]),
        (lambda: kl_estimate(f64([1.0]), f64([1.0, 2.0]), "k1"), ["ref_logprobs", "(1,)", "(2,)"]),
        (lambda: kl_estimate(f64([1.0]), f64([1.0]), "k4"), ["kind", "'k4'"]),
        (
            lambda: policy_loss(f64(LOGP), f64(LOGP), f64([1.0]), torch.tensor(PPO_MASK)),
            ["policy_loss: advantages", "n = 2", "(1,)"],
        ),
        (
            lambda: policy_loss(f64(LOGP), f64(LOGP), f64([[1.0]]), torch.tensor(PPO_MASK)),
            ["advantages", "(2, 4)", "(1, 1)"],
        ),
        (
            lambda: policy_loss(f64(LOGP), f64(LOGP)[:1], f64([1.0, 1.0]), torch.tensor(PPO_MASK)),
            ["old_logprobs", "(2, 4)"],
        ),
        (
            lambda: policy_loss(f64(LOGP), f64(LOGP), f64([1.0, 1.0]), torch.tensor(PPO_MASK), aggregation="foo"),
            ["policy_loss: aggregation", "'seq-mean-token-sum-norm'", "'foo'"],
        ),
        (lambda: policy_loss(f64(LOGP), f64(LOGP), f64([1, 1]), torch.tensor(PPO_MASK), clip=0), ["clip", "> 0"]),
        (
            lambda: policy_loss(f64(LOGP), f64(LOGP), f64([1, 1]), torch.tensor(PPO_MASK), dual_clip=0.9),
            ["dual_clip", "> 1", "0.9"],
        ),
        (lambda: kl_loss(f64(LOGP), f64(LOGP), torch.tensor(PPO_MASK), kind="k5"), ["kl_loss: kind", "'k5'"]),
        (lambda: kl_loss(f64(LOGP), f64(LOGP), torch.ones(2)), ["kl_loss: mask", "2 dimension"]),
        (
            lambda: value_loss(f64(V), f64(OLD_V), f64(RETURNS), torch.tensor(V_MASK), aggregation="sum"),
            ["value_loss: aggregation", "'sum'"],
        ),
        (lambda: value_loss(f64(V), f64(OLD_V), f64([[1.0]]), torch.tensor(V_MASK)), ["returns", "(1, 4)"]),
        (lambda: value_loss(f64(V), f64(OLD_V), f64(RETURNS), torch.tensor(V_MASK), clip=-1.0), ["clip", "> 0"]),
        (lambda: entropy_from_logits(f64(1.0)), ["logits", "0-d"]),
        (lambda: entropy_from_logits([0.0, 1.0]), ["logits", "torch.Tensor", "list"]),
    ],
)
def test_mistakes_raise_config_errors_naming_the_argument(call, words):
    with pytest.raises(ConfigError) as info:
        call()
    for word in words:
        assert word in str(info.value)
