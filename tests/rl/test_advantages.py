"""Advantage estimators against hand computations on small, written-out tensors."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from flowrl import ConfigError
from flowrl.rl import (
    expand_to_tokens,
    gae,
    group_advantages,
    reinforce_advantages,
    rloo_advantages,
    token_rewards,
)


def f64(values):
    return torch.tensor(values, dtype=torch.float64)


# groups 7 = {1, 4, 0} (not adjacent), 3 = {2, 5}, 9 = {3} (alone)
SCORES = [1.0, 2.0, 4.0, 0.0, 5.0, 3.0]
GROUPS = [7, 3, 7, 7, 3, 9]


def test_group_advantages_divide_by_the_bessel_corrected_group_std():
    # group 7: mean 5/3, deviations -2/3, 7/3, -5/3, squares sum 78/9, std sqrt((78/9) / 2) = sqrt(13/3)
    # group 3: mean 3.5, deviations -1.5, 1.5, std sqrt(4.5 / 1)
    eps = 1e-6
    s7, s3 = math.sqrt(13 / 3) + eps, math.sqrt(4.5) + eps
    expected = f64([(-2 / 3) / s7, -1.5 / s3, (7 / 3) / s7, (-5 / 3) / s7, 1.5 / s3, 0.0])
    assert_close(group_advantages(f64(SCORES), GROUPS, eps=eps), expected)
    assert_close(group_advantages(f64(SCORES), torch.tensor(GROUPS), eps=eps), expected)


def test_group_advantages_without_scaling_only_centre():
    expected = f64([-2 / 3, -1.5, 7 / 3, -5 / 3, 1.5, 0.0])
    assert_close(group_advantages(f64(SCORES), GROUPS, scale="none"), expected)


@pytest.mark.parametrize("scale", ["std", "none"])
def test_a_group_of_one_or_of_equal_scores_gets_zero(scale):
    result = group_advantages(f64([3.0, 2.0, 2.0, 2.0]), [0, 1, 1, 1], scale=scale)
    assert_close(result, f64([0.0, 0.0, 0.0, 0.0]))


def test_integer_scores_are_accepted():
    assert_close(group_advantages(torch.tensor([0, 1]), [5, 5], scale="none"), torch.tensor([-0.5, 0.5]))


def test_rloo_subtracts_the_mean_of_the_other_samples_of_the_group():
    # 1 - (4 + 0)/2, 2 - 5, 4 - (1 + 0)/2, 0 - (1 + 4)/2, 5 - 2, alone
    expected = f64([-1.0, -3.0, 3.5, -2.5, 3.0, 0.0])
    assert_close(rloo_advantages(f64(SCORES), GROUPS), expected)


@pytest.mark.parametrize(
    ("baseline", "whiten", "expected"),
    [
        ("none", False, [1.0, 2.0, 6.0]),
        ("batch-mean", False, [-2.0, -1.0, 3.0]),
        # std of [1, 2, 6] with divisor n - 1: sqrt((4 + 1 + 9) / 2) = sqrt(7)
        ("batch-mean", True, [-2.0 / (math.sqrt(7) + 1e-6), -1.0 / (math.sqrt(7) + 1e-6), 3.0 / (math.sqrt(7) + 1e-6)]),
        ("none", True, [1.0 / (math.sqrt(7) + 1e-6), 2.0 / (math.sqrt(7) + 1e-6), 6.0 / (math.sqrt(7) + 1e-6)]),
    ],
)
def test_reinforce_advantages(baseline, whiten, expected):
    scores = f64([1.0, 2.0, 6.0])
    assert_close(reinforce_advantages(scores, baseline=baseline, whiten=whiten), f64(expected))
    assert_close(scores, f64([1.0, 2.0, 6.0]))  # the input is not modified


# two right-padded rows: 3 and 2 valid tokens; pads hold junk that must not leak
LOGP = [[-1.0, -2.0, -0.5, 9.0], [-0.3, -0.7, 9.0, 9.0]]
REF = [[-1.5, -1.0, -0.5, -9.0], [-0.1, -0.7, -9.0, -9.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0]]


def test_token_rewards_with_k1_penalty_and_the_score_on_the_last_valid_token():
    # log ratios: row 0 [0.5, -1.0, 0.0], row 1 [-0.2, 0.0]; penalty -0.1 * ratio
    expected = f64([[-0.05, 0.1, 0.0 + 2.0, 0.0], [0.02, 0.0 - 1.0, 0.0, 0.0]])
    result = token_rewards(f64([2.0, -1.0]), f64(LOGP), f64(REF), torch.tensor(MASK), kl_coef=0.1)
    assert_close(result, expected)


def test_token_rewards_with_k3_penalty():
    def k3(d):
        return math.exp(-d) + d - 1

    expected = f64(
        [[-0.5 * k3(0.5), -0.5 * k3(-1.0), 3.0, 0.0], [-0.5 * k3(-0.2) + 0.5, 0.0, 0.0, 0.0]],
    )
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    result = token_rewards(f64([3.0, 0.5]), f64(LOGP), f64(REF), mask, kl_coef=0.5, kl="k3")
    assert_close(result, expected)


def test_gae_by_hand():
    rewards = f64([[1.0, 0.0, 2.0, 5.0], [0.5, 1.0, 5.0, 5.0]])
    values = f64([[0.5, 1.0, 1.5, 7.0], [2.0, 1.0, 7.0, 7.0]])
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72); row 0:
    #   t2: delta = 2 + 0 - 1.5 = 0.5                  A = 0.5
    #   t1: delta = 0 + 0.9 * 1.5 - 1.0 = 0.35         A = 0.35 + 0.72 * 0.5 = 0.71
    #   t0: delta = 1 + 0.9 * 1.0 - 0.5 = 1.4          A = 1.4 + 0.72 * 0.71 = 1.9112
    # row 1: t1: delta = 1 - 1 = 0, A = 0; t0: delta = 0.5 + 0.9 - 2 = -0.6, A = -0.6
    advantages, returns = gae(rewards, values, torch.tensor(MASK), gamma=0.9, lam=0.8)
    assert_close(advantages, f64([[1.9112, 0.71, 0.5, 0.0], [-0.6, 0.0, 0.0, 0.0]]))
    assert_close(returns, f64([[2.4112, 1.71, 2.0, 0.0], [1.4, 1.0, 0.0, 0.0]]))


def test_gae_skips_a_hole_inside_a_row():
    # t2: A = 2 - 1.5 = 0.5; t1 masked; t0: delta = 1 + 0.9 * 1.5 - 0.5 = 1.85, A = 1.85 + 0.72 * 0.5 = 2.21
    advantages, returns = gae(
        f64([[1.0, 99.0, 2.0]]), f64([[0.5, 99.0, 1.5]]), torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.8
    )
    assert_close(advantages, f64([[2.21, 0.0, 0.5]]))
    assert_close(returns, f64([[2.71, 0.0, 2.0]]))


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    rewards = f64([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    values = f64([[0.5, 0.25, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(returns, f64([[6.0, 5.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]]))
    assert_close(advantages, f64([[5.5, 4.75, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0]]))


def test_gae_outputs_are_detached():
    values = f64([[0.5, 1.0]]).requires_grad_()
    advantages, returns = gae(f64([[1.0, 1.0]]), values, torch.tensor([[1, 1]]))
    assert not advantages.requires_grad and not returns.requires_grad


def test_expand_to_tokens():
    assert_close(
        expand_to_tokens(f64([2.0, -1.0]), torch.tensor(MASK)), f64([[2.0, 2.0, 2.0, 0.0], [-1.0, -1.0, 0, 0]])
    )


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: group_advantages(f64([1.0, 2.0]), [0, 0], scale="mad"), ["scale", "'std', 'none'", "'mad'"]),
        (lambda: group_advantages(f64([1.0, 2.0]), [0, 0, 1]), ["groups", "(3,)"]),
        (lambda: group_advantages(f64([1.0, 2.0]), [0.5, 1.0]), ["groups", "integer"]),
        (lambda: group_advantages(f64([[1.0, 2.0]]), [0]), ["scores", "1 dimension"]),
        (lambda: group_advantages(f64([1.0, 2.0]), [0, 0], eps=0.0), ["eps", "> 0"]),
        (lambda: rloo_advantages(f64([1.0]), [[0]]), ["groups"]),
        (lambda: reinforce_advantages(f64([1.0]), baseline="ema"), ["baseline", "'batch-mean'", "'ema'"]),
        (lambda: reinforce_advantages(f64([1.0]), whiten=True), ["whiten", "at least 2"]),
        (
            lambda: token_rewards(f64([1.0]), f64(LOGP), f64(REF), torch.tensor(MASK), kl_coef=0.1),
            ["scores", "one value per row"],
        ),
        (
            lambda: token_rewards(f64([1.0, 1.0]), f64(LOGP), f64(REF)[:, :3], torch.tensor(MASK), kl_coef=0.1),
            ["ref_logprobs", "(2, 4)", "(2, 3)"],
        ),
        (
            lambda: token_rewards(
                f64([1.0, 1.0]), f64(LOGP), f64(REF), torch.tensor([[1, 0, 0, 0], [0] * 4]), kl_coef=0
            ),
            ["mask", "rows [1]"],
        ),
        (
            lambda: token_rewards(f64([1.0, 1.0]), f64(LOGP), f64(REF), torch.tensor(MASK), kl_coef=0.1, kl="k9"),
            ["token_rewards: kl", "'k9'"],
        ),
        (lambda: gae(f64([[1.0]]), f64([[1.0, 2.0]]), torch.tensor([[1]])), ["values", "(1, 2)"]),
        (lambda: gae(f64([[1.0]]), f64([[1.0]]), torch.tensor([[1]]), lam=1.5), ["lam", "[0, 1]", "1.5"]),
        (lambda: gae(f64([[1.0]]), f64([[1.0]]), torch.tensor([1])), ["mask", "2 dimension"]),
        (lambda: expand_to_tokens(f64([1.0, 2.0]), torch.tensor([[1, 1]])), ["mask", "n = 2"]),
    ],
)
def test_mistakes_raise_config_errors_naming_the_argument(call, words):
    with pytest.raises(ConfigError) as info:
        call()
    for word in words:
        assert word in str(info.value)
