"""The multi-turn example does what it says: games of 1 to LENGTH turns (a flowrl.loop), and
GRPO raises the reward and the turns a game lasts."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


def test_multiturn_tiny_raises_the_reward_and_the_turns(example):
    game = example("multiturn_tiny")
    episodes = 20
    stats = game.make_engine(episodes=episodes, backend="inprocess").learn()
    curve, turns = game.reward_curve(stats), game.turns_curve(stats)
    first, last = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    assert first < 0.25 and last > max(0.6, first + 0.2), curve
    assert turns[0] < 1.5 and turns[-1] > turns[0] + 1, turns
    loop = stats.rollout.loops["game"]
    assert loop.samples == episodes * 64 and loop.stops == {"done": loop.samples}
    assert set(loop.turn_counts) <= set(range(1, game.LENGTH + 1))
    between = [t for t in loop.turn_counts if 1 < t < game.LENGTH]
    assert loop.turn_counts.get(1) and loop.turn_counts.get(game.LENGTH) and between, loop.turn_counts
