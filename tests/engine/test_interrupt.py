"""Interrupting an engine: cancelling ``alearn()`` and Ctrl-C during ``learn()`` stop every
actor and leave the last checkpoint whole."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

import flowrl
from flowrl.testing import Scale, flowrl_actor_names

CPU = {"cpus_per_replica": 0.25}


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


@pytest.mark.parametrize("how", ["learn", pytest.param("with", marks=pytest.mark.slow)])  # slow: for time
def test_ctrl_c_during_learn_stops_every_actor_and_leaves_the_last_checkpoint_whole(tmp_path, how):
    import json
    import signal
    import subprocess
    import sys

    script = Path(__file__).with_name("_interrupt_script.py")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
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
    # one line says where the run stopped and names the last checkpoint (no later episode ran after it)
    stops = [line for line in err.splitlines() if line.startswith("flowrl: stopped")]
    assert len(stops) == 1, err[-3000:]
    done = int(re.search(r"\((\d+) done\)", stops[0])[1])
    named = int(re.search(r"last checkpoint \S+/episode-(\d+);", stops[0])[1])
    assert named == checkpoint["episode"] and done - 1 <= named <= done
    assert "Traceback" not in err
