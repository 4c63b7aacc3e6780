"""Replicas that die in the middle of a shard (real Ray actors whose processes exit)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl
from flowrl.testing import Scale, flowrl_actor_names

CPU = {"cpus_per_replica": 0.25}


class DieOn(flowrl.Model):
    """Adds ``<name>_out = x + 1``; the process running sample ``die_on`` exits at once, the
    first ``times`` times a replica meets it (a marker file per death counts them)."""

    def __init__(self, name: str, config: dict[str, Any], die_on: int, marks: str, times: int = 1) -> None:
        super().__init__(name, config)
        self.die_on, self.marks, self.times = die_on, marks, times

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        if self.die_on in batch.ids.tolist():
            deaths = len(os.listdir(self.marks))
            if deaths < self.times:
                Path(self.marks, f"death-{deaths}").write_text(str(self.replica_id))
                os._exit(1)
        return {f"{self.name}_out": [v[0] + 1 for v in batch["x"]]}


def _deaths(marks: Path) -> int:
    return len(list(marks.iterdir()))


def _dead_replica(marks: Path) -> int:
    """The replica of the first death."""
    return int(Path(marks, "death-0").read_text())


@pytest.mark.parametrize("channels", [True, False])
async def test_a_replica_killed_mid_shard_loses_no_sample_and_counts_none_twice(ray_cluster, tmp_path, channels):
    dying = DieOn("a", {"num_replicas": 3, "batch_size": 2, **CPU}, die_on=17, marks=str(tmp_path))
    after = Scale("b", {"num_replicas": 2, "batch_size": 3, **CPU}, srcs=["a_out"], dst="y", factor=2.0)
    items = [{"x": [i]} for i in range(40)]
    async with flowrl.open_pipeline(
        lambda x: after.forward_step(dying.forward_step(x)), {"local_channels": channels}
    ) as pipe:
        out = await pipe.run(items)
        stats = pipe.stats()
    assert _deaths(tmp_path) == 1
    assert [s.id for s in out] == list(range(40))  # each sample once, in order
    assert [s["y"] for s in out] == [2.0 * (i + 1) for i in range(40)]
    a, b = stats["a.forward_step"], stats["b.forward_step"]
    assert a.samples == 40 and b.samples == 40  # exact: the lost shard is counted once, when it completed
    # sent again: the dead replica's shards in flight (prefetch 2), and the outputs it had made
    # that the next stage had not read yet (they died with it and were computed again)
    dead = _dead_replica(tmp_path)
    made = next(r.samples for r in a.replicas if r.replica == dead)
    assert 1 <= a.retried <= 4 + made and b.retried == 0
    assert sum(r.samples > 0 for r in a.replicas) >= 2
    assert flowrl_actor_names() == []


async def test_a_sample_whose_replicas_keep_dying_fails_the_run_once_the_retry_budget_is_spent(ray_cluster, tmp_path):
    dying = DieOn("a", {"num_replicas": 3, "batch_size": 1, **CPU}, die_on=5, marks=str(tmp_path), times=10)
    with pytest.raises(flowrl.ReplicaDiedError, match=r"stage 'a\.forward_step'.*samples \[5\].*max_retries=1") as info:
        async with flowrl.open_pipeline(lambda x: dying.forward_step(x), {"max_retries": 1}) as pipe:
            await pipe.run([{"x": [i]} for i in range(12)])
    assert info.value.sample_ids == [5] and info.value.stage == "a.forward_step"
    assert _deaths(tmp_path) == 2  # sent once, retried once
    assert flowrl_actor_names() == []


async def test_when_every_replica_of_a_model_has_died_the_run_fails_naming_the_model(ray_cluster, tmp_path):
    config = {"num_replicas": 2, "batch_size": 1, "healing": None, **CPU}  # a dead replica is not replaced
    dying = DieOn("a", config, die_on=3, marks=str(tmp_path), times=10)
    with pytest.raises(flowrl.ReplicaDiedError, match="every replica of model 'a' has died"):
        async with flowrl.open_pipeline(lambda x: dying.forward_step(x), {"max_retries": 5}) as pipe:
            await pipe.run([{"x": [i]} for i in range(8)])
    assert _deaths(tmp_path) == 2
    assert flowrl_actor_names() == []


async def test_a_replica_that_dies_is_replaced_and_the_pool_keeps_its_size(ray_cluster, tmp_path):
    dying = DieOn("a", {"num_replicas": 3, "batch_size": 2, **CPU}, die_on=5, marks=str(tmp_path))
    items = [{"x": [i]} for i in range(24)]
    pipe_opened = time.time()
    async with flowrl.open_pipeline(lambda x: dying.forward_step(x)) as pipe:
        first = await pipe.run(items)
        await pipe.healed()  # the replacement starts in the background
        serving = pipe.serving("a")
        second = await pipe.run(items)  # the new replica takes shards like the others
        stats, events = pipe.stats()["a.forward_step"], pipe.scale_events
    assert _deaths(tmp_path) == 1
    assert [s["a_out"] for s in first] == [s["a_out"] for s in second] == [i + 1 for i in range(24)]
    assert stats.samples == 48  # each sample once per run: the dead replica's shard counted when it completed
    (event,) = events
    assert (event.action, event.before, event.after) == ("grow", 2, 3)
    assert event.recovery_s is not None and 0 <= event.recovery_s <= event.time - pipe_opened
    assert event.reason.startswith("replaced replica ") and event.reason.endswith(", which died (1 in a row)")
    (new,) = set(serving) - {0, 1, 2}
    assert new == 3  # ids are never reused
    assert flowrl_actor_names() == []


async def test_a_replica_that_keeps_dying_is_replaced_up_to_its_limit_then_left_out(ray_cluster, tmp_path, caplog):
    healing = {"max_restarts": 1, "backoff_s": 0.0}
    dying = DieOn("a", {"num_replicas": 2, "batch_size": 1, "healing": healing, **CPU}, 0, str(tmp_path), times=99)
    with pytest.raises(flowrl.ReplicaDiedError, match="every replica of model 'a' has died"):
        async with flowrl.open_pipeline(lambda x: dying.forward_step(x), {"max_retries": 10}) as pipe:
            await pipe.run([{"x": [0]}])  # every replica that takes this sample dies
    assert _deaths(tmp_path) == 4  # two replicas, each replaced once: 2 x (1 + max_restarts)
    left = [r.getMessage() for r in caplog.records if r.getMessage().endswith("left out")]
    assert len(left) == 2 and all("after 1 replacements in a row (Healing.max_restarts=1)" in m for m in left)
    assert flowrl_actor_names() == []


class NoRoomAfter(DieOn):
    """``DieOn`` whose replicas past the first ``num_replicas`` fail in setup (no room for a replacement)."""

    def setup(self) -> None:
        if self.replica_id >= self.config.replicas:
            raise RuntimeError("no room for a replacement")


async def test_when_no_replacement_can_start_for_the_last_replica_the_run_fails_instead_of_waiting(
    ray_cluster, tmp_path
):
    dying = NoRoomAfter("a", {"num_replicas": 1, "batch_size": 1, **CPU}, die_on=2, marks=str(tmp_path))
    with pytest.raises(flowrl.ReplicaDiedError, match=r"every replica of model 'a' has died and no replacement could"):
        async with flowrl.open_pipeline(lambda x: dying.forward_step(x)) as pipe:
            await pipe.run([{"x": [i]} for i in range(4)])
    assert _deaths(tmp_path) == 1
    assert flowrl_actor_names() == []


class FailsToStartOnce(DieOn):
    """``DieOn`` whose first replacement fails in setup (a marker file in ``starts``)."""

    def __init__(self, *args: Any, starts: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.starts = starts

    def setup(self) -> None:
        if self.replica_id >= self.config.replicas and not os.listdir(self.starts):
            Path(self.starts, "failed").touch()
            raise RuntimeError("the first replacement's setup fails")


async def test_a_replacement_that_fails_to_start_is_tried_again_and_the_pool_gets_back_its_size(ray_cluster, tmp_path):
    marks, starts = tmp_path / "marks", tmp_path / "starts"
    marks.mkdir(), starts.mkdir()
    config = {"num_replicas": 2, "batch_size": 1, "healing": {"backoff_s": 0.0}, **CPU}
    dying = FailsToStartOnce("a", config, die_on=2, marks=str(marks), starts=str(starts))
    async with flowrl.open_pipeline(lambda x: dying.forward_step(x)) as pipe:
        out = await pipe.run([{"x": [i]} for i in range(6)])
        await pipe.healed()
        serving = pipe.serving("a")
        events = [(e.action, e.reason) for e in pipe.scale_events]
    failed = "StageError: stage 'a.setup', replica 2, samples []: setup() failed: RuntimeError: "
    failed += "the first replacement's setup fails"
    assert _deaths(marks) == 1 and _deaths(starts) == 1
    assert [s["a_out"] for s in out] == [i + 1 for i in range(6)]
    (dead,) = {0, 1} - set(serving)
    assert sorted(serving) == sorted({0, 1, 3} - {dead})  # ids are never reused, not even a failed start's
    assert events == [("grow", f"replaced replica {dead}, which died (2 in a row); the last start: {failed}")]
    assert flowrl_actor_names() == []


class FirstCallKills(flowrl.Model):
    """Adds ``a_out = x + 1``; each of the first ``dying`` replicas exits on its first call, and a
    replacement's setup waits until ``dying`` replacements are in setup together (files in ``marks``)."""

    def __init__(self, name: str, config: dict[str, Any], dying: int, marks: str) -> None:
        super().__init__(name, config)
        self.dying, self.marks = dying, Path(marks)

    def setup(self) -> None:
        if self.replica_id < self.config.replicas:
            return
        Path(self.marks, f"start-{self.replica_id}").touch()
        deadline = time.monotonic() + 120.0  # a failure bound, not a wait for time: the loop waits on the files
        while len(list(self.marks.glob("start-*"))) < self.dying:
            if time.monotonic() > deadline:
                raise RuntimeError("no other replacement started beside this one")
            time.sleep(0.02)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        death = Path(self.marks, f"death-{self.replica_id}")
        if self.replica_id < self.dying and not death.exists():
            death.touch()
            os._exit(1)
        return {"a_out": [v[0] + 1 for v in batch["x"]]}


async def test_replicas_that_die_together_are_replaced_side_by_side(ray_cluster, tmp_path):
    config = {"num_replicas": 3, "batch_size": 1, "healing": {"backoff_s": 0.0}, **CPU}
    dying = FirstCallKills("a", config, dying=2, marks=str(tmp_path))
    async with flowrl.open_pipeline(lambda x: dying.forward_step(x)) as pipe:
        out = await pipe.run([{"x": [i]} for i in range(12)])
        await pipe.healed()  # each replacement's setup returns only once the other one is in setup too
        serving, events = pipe.serving("a"), pipe.scale_events
    assert [s["a_out"] for s in out] == [i + 1 for i in range(12)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["death-0", "death-1", "start-3", "start-4"]
    assert sorted(serving) == [2, 3, 4]
    assert sorted(e.reason.split(",")[0] for e in events) == ["replaced replica 0", "replaced replica 1"]
    assert all(e.action == "grow" for e in events)
    assert flowrl_actor_names() == []


def test_max_retries_must_not_be_negative():
    with pytest.raises(flowrl.ConfigError, match="max_retries"):
        flowrl.PipelineConfig(max_retries=-1)


class HangOn(flowrl.Model):
    """Adds ``<name>_out``; the call holding sample ``hang_on`` never returns (for the test's life)."""

    def __init__(self, name: str, config: dict[str, Any], hang_on: int) -> None:
        super().__init__(name, config)
        self.hang_on = hang_on

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        if self.hang_on in batch.ids.tolist():
            import threading

            threading.Event().wait()
        return {f"{self.name}_out": [0] * len(batch)}


@pytest.mark.parametrize("backend", ["channel", "ray-calls"])
async def test_a_step_that_hangs_past_its_deadline_fails_the_run_and_leaves_no_actor(ray_cluster, backend):
    # the step never returns: only the deadline ends the run (without it, pytest-timeout fails the test)
    model = HangOn("h", {"num_replicas": 2, "batch_size": 2, "call_timeout_s": 1.0, **CPU}, hang_on=6)
    with pytest.raises(flowrl.StageError, match=r"stage 'h\.forward_step'.*call_timeout_s=1s") as info:
        async with flowrl.open_pipeline(
            lambda x: model.forward_step(x), {"local_channels": backend == "channel"}
        ) as pipe:
            await pipe.run([{"x": [i]} for i in range(20)])
    assert 6 in info.value.sample_ids
    assert flowrl_actor_names() == []  # the hung replica was killed too


def test_a_call_deadline_must_be_positive():
    with pytest.raises(flowrl.ConfigError, match="call_timeout_s"):
        flowrl.ModelConfig(call_timeout_s=0)


class DrawOrDie(DieOn):
    """``DieOn``, drawing each sample's number from its own stream (``Batch.generators``)."""

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        super().forward_step(batch, iteration)
        return {"draw": [torch.rand(1, generator=g).item() for g in batch.generators()]}


async def test_a_sample_retried_after_its_replica_died_draws_what_it_would_have_drawn(ray_cluster, tmp_path):
    """A sample's stream is keyed by its id, not by the attempt: a retry on another replica
    draws the same numbers, so a failure does not change a seeded run (issue 24)."""
    draws = []
    for times, marks in [(0, tmp_path / "calm"), (1, tmp_path / "dying")]:
        marks.mkdir()
        model = DrawOrDie("a", {"num_replicas": 3, "batch_size": 2, **CPU}, die_on=9, marks=str(marks), times=times)
        async with flowrl.open_pipeline(model.forward_step, {"seed": 5}) as pipe:
            out = await pipe.run([{"x": [i]} for i in range(24)])
            retried = pipe.stats()["a.forward_step"].retried
        draws.append([s["draw"] for s in out])
        assert _deaths(marks) == times and (retried > 0) == (times > 0)
    assert draws[1] == draws[0] and len(set(draws[0])) == 24
