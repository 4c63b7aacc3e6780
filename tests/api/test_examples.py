"""The examples do what they say: PPO and GRPO raise the reward; the #209 example passes its checks."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from _delays import delayed

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


def improvement(curve: list[float]) -> tuple[float, float]:
    return sum(curve[:3]) / 3, sum(curve[-3:]) / 3


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
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


def trained(engine: Any, curve: Any, folder: Path) -> tuple[list[float], dict[str, bytes]]:
    """The reward curve, and each trainer's model as the last checkpoint saved it."""
    rewards = curve(engine.learn())
    last = sorted(folder.glob("episode-*"))[-1]
    return rewards, {p.name: p.read_bytes() for p in sorted(last.glob("*.model.msgpack"))}


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
def test_the_tiny_examples_train_bitwise_the_same_whatever_the_layout(ray_cluster, example, tmp_path, monkeypatch):
    """Each sample draws from its own stream (issue 24): the replica layout (replicas x shard
    size 2x4 and 3x3), the backend, the trainer's rank count and the timing (random delays in
    process) do not change what a seed trains."""
    ppo, grpo = example("ppo_tiny"), example("grpo_tiny")
    setups = [("inprocess", 1, (2, 4, 2, 4)), ("ray", 2, (3, 3, 3, 3))]
    delayed(monkeypatch, ppo, 0)  # in process; Ray's own timing varies
    runs = []
    for i, (backend, ranks, layout) in enumerate(setups):
        folder = tmp_path / f"ppo-{i}"
        engine = ppo.make_engine(
            3, backend, ranks, rollout=layout, checkpoint={"dir": str(folder), "every": 3}, progress="off"
        )
        runs.append(trained(engine, ppo.reward_curve, folder))
    assert runs[0][1] and runs[1] == runs[0]
    other = ppo.make_engine(3, "inprocess", 1, seed=1).learn()
    assert ppo.reward_curve(other) != runs[0][0]
    grpo_runs = []
    for backend, layout in [("inprocess", (3, 3, 3, 3)), ("ray", (2, 4, 2, 4))]:  # the other way round
        folder = tmp_path / f"grpo-{backend}"
        engine = grpo.make_engine(
            3, backend, rollout_layout=layout, checkpoint={"dir": str(folder), "every": 3}, progress="off"
        )
        grpo_runs.append(trained(engine, grpo.reward_curve, folder))
    assert grpo_runs[0][1] and grpo_runs[1] == grpo_runs[0]


@pytest.mark.slow  # a minute on 2 cores: two Ray runs with 3 trainer ranks (python -m pytest -q -m slow)
def test_three_trainer_ranks_train_the_same_weights_whatever_the_rollout_layout(ray_cluster, example, tmp_path):
    """The trainers sum gradients over ranks in a fixed order for a given rank count: with 3
    ranks, rollouts of 2x4 and 3x3 train byte-for-byte the same models (1 rank sums in another
    order: docs/reproducibility.md)."""
    ppo = example("ppo_tiny")
    runs = []
    for i, layout in enumerate([(2, 4, 2, 4), (3, 3, 3, 3)]):
        folder = tmp_path / f"ppo-{i}"
        engine = ppo.make_engine(
            3, "ray", 3, rollout=layout, checkpoint={"dir": str(folder), "every": 3}, progress="off"
        )
        runs.append(trained(engine, ppo.reward_curve, folder))
    assert runs[0][1] and runs[1] == runs[0]
