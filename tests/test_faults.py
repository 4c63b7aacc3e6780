"""Replicas that die in the middle of a shard (real Ray actors whose processes exit)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

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
                Path(self.marks, f"death-{deaths}").touch()
                os._exit(1)
        return {f"{self.name}_out": [v[0] + 1 for v in batch["x"]]}


def _deaths(marks: Path) -> int:
    return len(list(marks.iterdir()))


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
    assert 1 <= a.retried <= 4 and b.retried == 0  # the dead replica's shards in flight (prefetch 2)
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
    dying = DieOn("a", {"num_replicas": 2, "batch_size": 1, **CPU}, die_on=3, marks=str(tmp_path), times=10)
    with pytest.raises(flowrl.ReplicaDiedError, match="every replica of model 'a' has died"):
        async with flowrl.open_pipeline(lambda x: dying.forward_step(x), {"max_retries": 5}) as pipe:
            await pipe.run([{"x": [i]} for i in range(8)])
    assert _deaths(tmp_path) == 2
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
    import time

    model = HangOn("h", {"num_replicas": 2, "batch_size": 2, "call_timeout_s": 1.0, **CPU}, hang_on=6)
    start = time.monotonic()
    with pytest.raises(flowrl.StageError, match=r"stage 'h\.forward_step'.*call_timeout_s=1s") as info:
        async with flowrl.open_pipeline(
            lambda x: model.forward_step(x), {"local_channels": backend == "channel"}
        ) as pipe:
            await pipe.run([{"x": [i]} for i in range(20)])
    assert 6 in info.value.sample_ids and time.monotonic() - start < 60
    assert flowrl_actor_names() == []  # the hung replica was killed too


def test_a_call_deadline_must_be_positive():
    with pytest.raises(flowrl.ConfigError, match="call_timeout_s"):
        flowrl.ModelConfig(call_timeout_s=0)


async def test_cancelling_alearn_mid_run_stops_every_actor(ray_cluster):
    import anyio

    from flowrl.testing import CountingTrainer

    policy = Scale("policy", {"num_replicas": 2, "batch_size": 2, **CPU}, srcs=["x"], dst="y", sleep_s=0.02)
    trainer = CountingTrainer("trainer", {"num_replicas": 2, **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={"sample_per_episode": 8, "num_episode": 100, "train_global_batch_size": 8},
    )
    relayed = anyio.Event()

    def relay(episodes):
        relayed.set()  # the first episode's rollout is done: the run is in full swing
        return episodes[-1].buffer

    engine.set_relay_sample_fn(relay)
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(64)])
    async with anyio.create_task_group() as tg:

        async def cancel_once_relayed() -> None:
            await relayed.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(cancel_once_relayed)
        await engine.alearn()
    assert relayed.is_set() and flowrl_actor_names() == []


def test_ctrl_c_during_learn_stops_every_actor_and_leaves_the_last_checkpoint_whole(tmp_path):
    import json
    import signal
    import subprocess
    import sys

    script = Path(__file__).with_name("_interrupt_script.py")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the third episode's rollout is done
        assert line.strip() == "rolling", proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)  # an interrupted run must not hang
    finally:
        proc.kill()
    result = json.loads(out.strip().splitlines()[-1])
    checkpoint = result.pop("checkpoint")
    assert result == {"outcome": "interrupted", "left": []}, err[-3000:]
    assert checkpoint["episode"] >= 2 and checkpoint["hidden"] == []  # read back whole, nothing half-written
    assert checkpoint["files"] == ["engine.json", "relay.msgpack", "trainer.model.msgpack", "trainer.rng.msgpack"]
