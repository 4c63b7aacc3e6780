"""Resizing an engine's inference pools on a real local Ray cluster: mid-episode (new replicas
get the current weights), asked for by `flowrl scale`, and the mistakes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest
from _resume_models import make_engine

import flowrl
from flowrl._engine.elastic import DONE, FAILED, REQUEST, ScaleRequest, request_scale
from flowrl._engine.run_folder import LIVE, write_atomic
from flowrl.testing import flowrl_actor_names

if TYPE_CHECKING:
    from collections.abc import Callable


def test_the_engine_resizes_its_policy_mid_episode_and_new_replicas_get_the_current_weights(ray_cluster):
    from ray.util.queue import Queue

    episodes = 8
    shards = Queue(actor_options={"num_cpus": 0})  # (replica, samples) per shard the policy finished
    # each policy shard takes a permit first: the rollout pauses after 6 shards (in episode 1) until
    # the new replicas serve, since starting actors on a busy machine can outlast the whole run
    permits = Queue(actor_options={"num_cpus": 0})
    engine, _ = make_engine(
        sync_every=1, max_relay_episode=0, num_episode=episodes, rollout_s=0.1, report=shards, gate=permits
    )
    done: Counter[int] = Counter()  # samples per policy replica, as the replicas report them
    reports = Counter[str]()

    async def until(condition: Callable[[Counter[int]], bool]) -> None:
        """Take the replicas' reports as they come until ``condition(done)`` holds."""
        while not condition(done):
            report = await shards.get_async()
            assert report is not None, f"the run ended first: {dict(done)}"
            replica, samples = report
            done[replica] += samples
            reports["shards"] += 1

    async def main():
        async with engine:
            async with anyio.create_task_group() as tg:

                async def learn() -> None:
                    await engine.alearn()
                    await shards.put_async(None)  # the run is over: no report comes any more

                for _ in range(6):
                    await permits.put_async(True)
                tg.start_soon(learn)
                await until(lambda _: reports["shards"] == 6)  # the rollout waits for permits now
                assert await engine.aresize("policy", 4) == [2, 3]
                assert shards.empty()  # nothing ran while they started
                for _ in range(episodes * 8):  # enough for the rest of the run: a shard holds >= 1 sample
                    await permits.put_async(True)
                await until(lambda d: d[2] > 0 and d[3] > 0)  # both added replicas worked
                half = done.total() // 8 * 8 + 12
                await until(lambda d: d.total() >= half)  # halfway through the episode after that
                assert len(await engine.aresize("policy", 1)) == 3
            return engine.stats(), flowrl_actor_names()

    try:
        stats, names = anyio.run(main)
    finally:
        shards.shutdown()
        permits.shutdown()
    rollout = stats.rollout.stages["policy.forward_step"]
    assert rollout.samples == episodes * 8 and rollout.retried == 0
    assert {r.replica for r in rollout.replicas if r.samples} >= {2, 3}  # the added replicas worked
    for e, episode in enumerate(stats.episodes):
        assert episode.staleness == {"policy": {0: 8}}, e  # every replica ran the current weights
    trained_ids = sorted(i for ep in engine.train_results for r in ep["learner"][:2] for x in r for i in x["ids"])
    assert trained_ids == list(range(episodes * 8))  # each sample trained once (first epoch)
    assert stats.rollout.serving == {"policy": 1}
    assert sum(1 for n in names if "-policy-" in n) == 1  # the removed replicas' actors are gone
    assert flowrl_actor_names() == []


def test_flowrl_scale_asks_a_running_engine_to_resize(ray_cluster, tmp_path):
    engine, _ = make_engine(sync_every=1, max_relay_episode=0, run_dir=str(tmp_path))

    async def main():
        async with engine:
            rollout = engine._session.deployment.rollout
            resize, (tell, handled) = rollout.resize, anyio.create_memory_object_stream[str](4)

            async def resize_and_tell(model: str, replicas: int, **kw: Any) -> list[int]:
                """The pool's resize, which a request ends in; says when it is over, whatever the outcome
                (the watcher writes what was done, or the error, before it waits again)."""
                try:
                    return await resize(model, replicas, **kw)
                finally:
                    tell.send_nowait(model)

            rollout.resize = resize_and_tell
            async with anyio.create_task_group() as tg:
                # the run's marker (live.json) is written when start() returns: `flowrl scale` needs one
                run = await tg.start(engine._session.elasticity.watch_requests, tmp_path)
                out = await anyio.to_thread.run_sync(
                    lambda: subprocess.run(
                        [sys.executable, "-m", "flowrl", "scale", str(tmp_path), "policy=3"],
                        capture_output=True,
                        text=True,
                        timeout=120,
                    )
                )
                assert out.returncode == 0, out.stderr
                assert await handled.receive() == "policy"
                with pytest.raises(flowrl.ConfigError, match=r"has no rollout model 'nope' to resize"):
                    request_scale(tmp_path, {"nope": 2})  # the command knows the run's models
                # one written by hand gets past it: the engine writes the mistake back and goes on
                write_atomic(tmp_path / REQUEST, msgspec.json.encode(ScaleRequest(run=run.run_id, sizes={"nope": 2})))
                assert await handled.receive() == "nope"
                tg.cancel_scope.cancel()
            return rollout.serving("policy"), run.run_id

    serving, run_id = anyio.run(main)
    assert serving == [0, 1, 2]
    assert json.loads((tmp_path / DONE).read_bytes()) == {
        "run": run_id,
        "requested": {"policy": 3},
        "changed": {"policy": [2]},
    }
    assert "ConfigError: no model 'nope' in this pipeline" in (tmp_path / FAILED).read_text()
    assert not (tmp_path / LIVE).exists()  # the watcher's end removed the marker
    with pytest.raises(flowrl.ConfigError, match="no live run in"):
        request_scale(tmp_path, {"policy": 2})
    with pytest.raises(flowrl.ConfigError, match="not a folder"):
        request_scale(tmp_path / "missing", {"policy": 2})


def test_resize_mistakes_on_an_engine_are_named(tmp_path):
    engine, _ = make_engine(pipeline={"backend": "inprocess"}, policy_replicas=1, ranks=1)
    with pytest.raises(flowrl.PipelineClosedError, match="resize\\(\\) needs an engine open with `with engine:`"):
        engine.resize("policy", 2)
    with engine:
        with pytest.raises(
            flowrl.ConfigError, match="'learner' is a trainer: a data-parallel group keeps its world size"
        ):
            engine.resize("learner", 2)
        assert engine.resize("policy", 2) == [1]  # between learn() calls too
        stats = engine.learn()
    assert {r.replica for r in stats.rollout.stages["policy.forward_step"].replicas} == {0, 1}


def test_autoscale_on_a_colocated_model_is_refused_when_the_engine_is_built():
    with pytest.raises(flowrl.ConfigError, match="model 'policy' has ModelConfig.autoscale, but colocated replicas"):
        make_engine(
            colocation=[["policy", "learner"]], models={"policy": {"num_replicas": 2, "autoscale": {"max_replicas": 4}}}
        )
