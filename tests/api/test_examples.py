"""The examples do what they say: PPO and GRPO raise the reward; the #209 example passes its checks."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


def improvement(curve: list[float]) -> tuple[float, float]:
    return sum(curve[:3]) / 3, sum(curve[-3:]) / 3


def test_ppo_tiny_raises_the_reward_on_ray_with_two_trainer_ranks(ray_cluster, example):
    ppo = example("ppo_tiny")
    stats = ppo.make_engine(episodes=24, backend="ray", trainer_ranks=2).learn()
    first, last = improvement(ppo.reward_curve(stats))
    assert first < 0.25 and last > first + 0.2, (first, last)
    assert stats.trainers["ppo_policy"].samples == 24 * 64 * 4  # 4 epochs over each episode
    assert [e.weight_versions["policy"] for e in stats.episodes] == list(range(1, 25))


def test_grpo_tiny_raises_the_reward(example):
    grpo = example("grpo_tiny")
    first, last = improvement(grpo.reward_curve(grpo.make_engine(episodes=24, backend="inprocess").learn()))
    assert first < 0.25 and last > first + 0.2, (first, last)


def test_fanout_example_passes_its_own_checks(example):
    fanout = example("fanout_utilization")
    assert fanout.main(["--inprocess"]) == 0


def test_the_tiny_examples_give_the_same_reward_curve_on_ray_and_in_process(ray_cluster, example):
    """Each sample draws from its own stream (issue 24): the layout (Ray with the trainer on 2
    ranks, or in process on 1) and the timing do not change what a seed gives."""
    ppo, grpo = example("ppo_tiny"), example("grpo_tiny")
    in_process = ppo.reward_curve(ppo.make_engine(episodes=3, backend="inprocess", trainer_ranks=1).learn())
    on_ray = ppo.reward_curve(ppo.make_engine(episodes=3, backend="ray", trainer_ranks=2).learn())
    assert on_ray == in_process
    other_seed = ppo.reward_curve(ppo.make_engine(episodes=3, backend="inprocess", trainer_ranks=1, seed=1).learn())
    assert other_seed != in_process
    curves = [grpo.reward_curve(grpo.make_engine(episodes=3, backend=b).learn()) for b in ("inprocess", "ray")]
    assert curves[0] == curves[1]
