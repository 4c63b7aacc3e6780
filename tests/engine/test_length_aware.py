"""Length-aware rollouts: the engine remembers each prompt's response length and the next
rollout starts the longest first; a hook can predict instead; checkpoints keep the memory."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl.testing import CountingTrainer

SEEN: list[int] = []  # the prompts in the order the policy ran them (in-process: one process)
LENGTHS = [5, 40, 1, 23, 8, 31, 2, 17]  # each prompt's response length, the same every episode


class Generator(flowrl.Model):
    """One sample per call, so the order of calls is the order the scheduler chose."""

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        prompts = [int(p) for p in batch["p"]]
        SEEN.extend(prompts)
        return {"response": [list(range(LENGTHS[p])) for p in prompts]}


def _engine(tmp_path=None, predict_cost=None, **config: Any) -> flowrl.Engine:
    policy = Generator("policy", {"num_replicas": 1, "batch_size": 1, "prefetch": 1})
    run = {
        "sample_per_episode": len(LENGTHS),
        "num_episode": 2,
        "length_field": "response",
        "pipeline": {"backend": "inprocess", "progress": "off"},
        **config,
    }
    if tmp_path is not None:
        run |= {"checkpoint": {"dir": str(tmp_path), "every": 1, **run.get("checkpoint", {})}}
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[CountingTrainer("trainer", {"num_replicas": 1})],
        config=run,
        predict_cost=predict_cost,
    )
    engine.set_dataset([{"p": np.int64(i)} for i in range(len(LENGTHS))])
    return engine


def _episodes(n: int) -> list[list[int]]:
    size = len(SEEN) // n
    return [SEEN[i * size : (i + 1) * size] for i in range(n)]


def test_the_first_rollout_runs_in_order_and_the_next_starts_with_the_longest():
    SEEN.clear()
    _engine().learn()
    first, second = _episodes(2)
    assert first == list(range(len(LENGTHS)))  # nothing remembered: oldest first, as before
    assert second == sorted(range(len(LENGTHS)), key=lambda p: -LENGTHS[p])


def test_a_hook_predicts_from_the_item_and_what_was_remembered():
    SEEN.clear()
    calls: list[tuple[int, float | None]] = []

    def shortest_first(item: Any, remembered: float | None) -> Any:
        calls.append((int(item["p"]), remembered))
        return np.float32(100.0 - (remembered or 0.0))  # a numpy number is a number too

    _engine(predict_cost=shortest_first).learn()
    _, second = _episodes(2)
    assert second == sorted(range(len(LENGTHS)), key=lambda p: LENGTHS[p])
    assert calls[: len(LENGTHS)] == [(p, None) for p in range(len(LENGTHS))]
    assert calls[len(LENGTHS) :] == [(p, float(LENGTHS[p])) for p in range(len(LENGTHS))]


def test_a_resumed_run_remembers_the_lengths_of_the_checkpoint(tmp_path):
    SEEN.clear()
    _engine(tmp_path, num_episode=1).learn()
    SEEN.clear()
    _engine(tmp_path, num_episode=2).learn()  # resumes after episode 1: only the second runs
    assert SEEN == sorted(range(len(LENGTHS)), key=lambda p: -LENGTHS[p])


def test_a_length_field_the_rollout_does_not_have_is_named():
    with pytest.raises(flowrl.ConfigError, match=r"RunConfig.length_field='answer': sample 0 .* no such field"):
        _engine(length_field="answer").learn()


def test_a_hook_that_returns_no_number_is_named():
    with pytest.raises(flowrl.ConfigError, match=r"predict_cost=\.\.\.\) returned 'long' for item 0 of episode 0"):
        _engine(predict_cost=lambda item, remembered: "long").learn()
    with pytest.raises(flowrl.ConfigError, match="expected a function"):
        _engine(predict_cost=3)
