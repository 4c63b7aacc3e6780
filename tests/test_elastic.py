"""Elastic pools: replicas added and removed mid-run (scheduler, policy sans-IO; pipelines and
the engine on a real local Ray cluster), and the autoscaler within its limits."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import anyio
import numpy as np
import pytest
from _resume_models import make_engine

import flowrl
from flowrl._core.autoscale import AutoscalePolicy, Reading
from flowrl._core.scheduler import PoolScheduler
from flowrl._engine.elastic import DONE, FAILED, request_scale
from flowrl.testing import Scale, flowrl_actor_names

STAGE = "m.forward_step"
CPU = {"cpus_per_replica": 0.1}


# ---- the scheduler and the policy, sans-IO ----
def test_an_added_replica_is_served_first_and_a_retired_one_finishes_its_shard():
    s = PoolScheduler(replicas=2, policy="greedy")
    s.add_stage(STAGE, 1)
    s.expect(STAGE, 4)
    s.ready(STAGE, [0, 1, 2, 3])
    s.request(0)
    (a,) = s.poll()
    assert s.add_replica() == 2 and s.serving == 3
    s.request(1)
    s.request(2)
    assert [x.replica for x in s.poll()] == [2, 1]  # never served: first
    s.retire(0)  # removed while its shard runs: no new shard, the one it holds finishes
    s.finish(a)
    with pytest.raises(ValueError, match="retired"):
        s.request(0)
    assert s.serving == 2 and s.in_flight[0] == 0


def reading(serving=2, queued=0, starved=0.0, batch=2, model="m"):
    return Reading(model=model, serving=serving, queued=queued, starved=starved, batch_size=batch, cpus=1.0)


def policy(**cfg):
    return AutoscalePolicy({"m": flowrl.Autoscale(**{"max_replicas": 6, "patience": 2, **cfg})})


@pytest.mark.parametrize("queued, room, after", [(8, 10, 4), (40, 10, 6), (40, 1, 3), (5, 10, 3), (40, 0, None)])
def test_a_long_queue_grows_the_pool_after_patience_within_max_and_room(queued, room, after):
    p = policy()
    free = {"CPU": float(room)}  # a replica asks for 1 CPU
    assert p.decide([reading(queued=queued)], free) == []  # one reading is not enough
    events = p.decide([reading(queued=queued)], free)
    if after is None:
        assert events == []  # no room: nothing to do
        return
    (event,) = events
    assert (event.action, event.before, event.after) == ("grow", 2, after)
    assert "grow_queue" in event.reason and event.reading.queued == queued


@pytest.mark.parametrize(
    "serving, starved, minimum, after",
    [(6, 0.9, 1, 1), (6, 0.5, 1, 3), (6, 0.9, 2, 2), (2, 0.9, 2, None), (4, 0.3, 1, None), (3, 0.6, 1, 2)],
)
def test_a_starved_pool_shrinks_to_the_work_it_did_but_not_below_min(serving, starved, minimum, after):
    p = policy(min_replicas=minimum)
    for _ in range(3):
        events = p.decide([reading(serving=serving, starved=starved)], {})
        if events:
            break
    if after is None:
        assert events == []
    else:
        assert [(e.action, e.after) for e in events] == [("shrink", after)]


def test_readings_must_come_in_a_row():
    p = policy(patience=3)
    for r in (reading(queued=20), reading(queued=20), reading(), reading(queued=20), reading(queued=20)):
        assert p.decide([r], {"CPU": 8}) == []
    p.reset()
    assert p.decide([reading(queued=20)], {"CPU": 8}) == []


def test_what_a_shrink_frees_is_there_for_a_grow_in_the_same_tick():
    p = AutoscalePolicy({m: flowrl.Autoscale(max_replicas=5, patience=1) for m in ("a", "b")})
    events = p.decide(
        [reading(model="a", serving=3, queued=40), reading(model="b", serving=3, starved=0.7)], {"CPU": 0.0}
    )
    assert [(e.model, e.action, e.before, e.after) for e in events] == [("b", "shrink", 3, 1), ("a", "grow", 3, 5)]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"max_replicas": 2, "min_replicas": 3}, "below min_replicas"),
        ({"max_replicas": 2, "shrink_starved": 1.5}, "shrink_starved"),
        ({"max_replicas": 0}, "max_replicas must be > 0"),
    ],
)
def test_bad_autoscale_settings_are_named(bad, message):
    with pytest.raises(flowrl.ConfigError, match=message):
        flowrl.Autoscale(**bad)


def test_a_start_count_outside_the_autoscale_limits_is_refused():
    with pytest.raises(flowrl.ConfigError, match=r"5 replicas to start with, outside autoscale's \[min_replicas=1"):
        flowrl.ModelConfig(num_replicas=5, autoscale={"max_replicas": 4})


# ---- pipelines on Ray ----
def counts(pipe) -> dict[int, int]:
    return {r.replica: r.samples for r in pipe.stats().stages[STAGE].replicas}


@pytest.mark.parametrize("backend", ["ray", "inprocess"])
def test_replicas_added_and_removed_mid_run_keep_accounting_exact(ray_cluster, backend):
    m = Scale("m", {"num_replicas": 2, "batch_size": 2, **CPU}, srcs=["x"], dst="y", sleep_s=0.03)
    n = 400

    async def main():
        async with flowrl.open_pipeline(
            lambda x: m.forward_step(x), {"backend": backend, "progress": "off", "max_inflight": 64}
        ) as pipe:
            got = []
            async for s in pipe.stream([{"x": np.full(1, float(i))} for i in range(n)]):
                got.append(s)
                if len(got) == 40:
                    assert await pipe.add_replicas("m", 2) == [2, 3]
                if len(got) == 200:
                    removed = await pipe.remove_replicas("m", 3)
                    assert len(removed) == 3 and pipe.busy()["m"][1] == 1
                    after_removal = counts(pipe)
                    if backend == "ray":
                        assert len(flowrl_actor_names()) == 1  # their actors are gone
            return got, after_removal, removed, pipe.stats(), list(pipe.scale_events)

    got, after_removal, removed, stats, events = anyio.run(main)
    assert [s.id for s in got] == list(range(n)) and [float(s["y"][0]) for s in got] == [float(i) for i in range(n)]
    stage = stats.stages[STAGE]
    assert stage.samples == n and stage.retried == 0  # each sample once, none sent again
    assert stats.serving == {"m": 1}
    per = {r.replica: r.samples for r in stage.replicas}
    assert sum(per.values()) == n and per[2] > 0 and per[3] > 0  # the added replicas worked
    assert all(per[r] == after_removal[r] for r in removed)  # the removed ones did nothing after
    assert Counter(s["m_replica"] for s in got) == Counter(per)
    assert [(e.action, e.before, e.after) for e in events] == [("grow", 2, 4), ("shrink", 4, 1)]
    assert flowrl_actor_names() == []


class Slow(Scale):
    """Sample 0 is quick, every other takes 0.4 s: when sample 0 is back, both replicas are
    in the middle of a long shard."""

    def _delay(self, batch):
        return 0.02 if int(batch.ids[0]) == 0 else 0.4


def test_a_replica_removed_mid_shard_finishes_it(ray_cluster):
    m = Slow("m", {"num_replicas": 2, "batch_size": 1, "prefetch": 1, **CPU}, srcs=["x"], dst="y")

    async def main():
        async with flowrl.open_pipeline(lambda x: m.forward_step(x), {"progress": "off"}) as pipe:
            got = []
            async for s in pipe.stream([{"x": np.ones(1)} for _ in range(6)]):
                got.append(s)
                if len(got) == 1:
                    assert pipe.busy()["m"] == (2, 2)  # both replicas are mid-shard
                    removed = await pipe.remove_replicas("m", 1)
            return got, removed, pipe.stats()

    got, (removed,), stats = anyio.run(main)
    assert len({s.id for s in got}) == 6 and stats.stages[STAGE].retried == 0
    by = Counter(s["m_replica"] for s in got)
    assert by[removed] >= 1 and by[1 - removed] == 6 - by[removed]  # its shard finished there, not sent again


def test_resize_errors_name_the_model_and_the_limit(ray_cluster):
    m = Scale("m", {"num_replicas": 2, **CPU}, srcs=["x"], dst="y")

    async def main():
        async with flowrl.open_pipeline(
            lambda x: m.forward_step(x), {"backend": "inprocess", "progress": "off"}
        ) as pipe:
            with pytest.raises(flowrl.ConfigError, match=r"no model 'q' in this pipeline; its models are \['m'\]"):
                await pipe.resize("q", 2)
            with pytest.raises(flowrl.ConfigError, match="at least 1 replica"):
                await pipe.resize("m", 0)
            with pytest.raises(flowrl.ConfigError, match="at least one must stay"):
                await pipe.remove_replicas("m", 2)

    anyio.run(main)


def test_a_replica_that_cannot_join_is_stopped_at_once_and_the_pool_grows_later(ray_cluster):
    m = Scale("m", {"num_replicas": 1, **CPU}, srcs=["x"], dst="y")

    async def refuse(handle):
        raise flowrl.StageError("no weights for it", "m.set_weights", handle.replica_id, [])

    async def main():
        async with flowrl.open_pipeline(lambda x: m.forward_step(x), {"progress": "off"}) as pipe:
            pipe.join_hook = refuse  # what an engine's weight hand-over does when it fails
            with pytest.raises(flowrl.StageError, match="no weights for it"):
                await pipe.add_replicas("m", 2)
            names = flowrl_actor_names()
            pipe.join_hook = None
            assert await pipe.add_replicas("m", 1) == [1]  # the ids the failed joins had are free
            samples = await pipe.run([{"x": np.ones(1)} for _ in range(16)])
            return names, samples, pipe.stats()

    names, samples, stats = anyio.run(main)
    assert sum(1 for n in names if "-m-" in n) == 1  # the two that could not join are gone already
    assert len(samples) == 16 and {r.replica for r in stats.stages["m.forward_step"].replicas if r.samples} <= {0, 1}
    assert flowrl_actor_names() == []


def test_the_autoscaler_grows_a_queued_pool_and_shrinks_a_starved_one_within_limits(ray_cluster):
    slow = Scale(
        "slow",
        {"num_replicas": 1, "batch_size": 1, **CPU, "autoscale": {"max_replicas": 3, "every_s": 0.1, "patience": 2}},
        srcs=["x"],
        dst="y",
        sleep_s=0.05,
    )
    fast = Scale(
        "fast",
        {
            "num_replicas": 3,
            "batch_size": 1,
            **CPU,
            "autoscale": {"min_replicas": 2, "max_replicas": 3, "every_s": 0.1, "patience": 2},
        },
        srcs=["y"],
        dst="z",
    )

    async def main():
        async with flowrl.open_pipeline(lambda x: fast.forward_step(slow.forward_step(x)), {"progress": "off"}) as pipe:
            samples = await pipe.run([{"x": np.ones(1)} for _ in range(80)])
            return samples, list(pipe.scale_events), pipe.stats(), pipe.timeline.spans

    samples, events, stats, spans = anyio.run(main)
    assert len(samples) == 80 and stats.stages["slow.forward_step"].samples == 80
    grown = [e for e in events if e.model == "slow"]
    assert grown and grown[0].action == "grow" and all(e.after <= 3 for e in grown)
    assert all(e.reading is not None and e.reading.queued >= e.reading.serving * 1 for e in grown if e.action == "grow")
    shrunk = [e for e in events if e.model == "fast"]
    assert shrunk and all(e.action == "shrink" and e.after >= 2 for e in shrunk)  # starved downstream of `slow`
    assert {s.name for s in spans if s.group == "autoscale"} >= {"grow slow", "shrink fast"}  # on the timeline
    assert flowrl_actor_names() == []


# ---- the engine ----
def test_the_engine_resizes_its_policy_mid_episode_and_new_replicas_get_the_current_weights(ray_cluster):
    episodes = 8
    engine, _ = make_engine(sync_every=1, max_relay_episode=0, num_episode=episodes, rollout_s=0.1)

    async def generated() -> int:
        return engine.stats().rollout.stages["policy.forward_step"].samples

    async def by_new_replicas() -> int:
        return sum(r.samples for r in engine.stats().rollout.stages["policy.forward_step"].replicas if r.replica >= 2)

    async def main():
        async with engine:
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.alearn)
                with anyio.fail_after(60):
                    while await generated() < 12:  # halfway through episode 1
                        await anyio.sleep(0.005)
                    assert await engine.aresize("policy", 4) == [2, 3]
                    while not await by_new_replicas():
                        await anyio.sleep(0.005)
                    now = await generated()
                    while await generated() < now // 8 * 8 + 12:  # halfway through the next episode
                        await anyio.sleep(0.005)
                    assert len(await engine.aresize("policy", 1)) == 3
            return engine.stats(), flowrl_actor_names()

    stats, names = anyio.run(main)
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
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine._session.elasticity.watch_requests, tmp_path)
                out = await anyio.to_thread.run_sync(
                    lambda: subprocess.run(
                        [sys.executable, "-m", "flowrl", "scale", str(tmp_path), "policy=3"],
                        capture_output=True,
                        text=True,
                        timeout=60,
                    )
                )
                assert out.returncode == 0, out.stderr
                with anyio.fail_after(20):
                    while not (tmp_path / DONE).exists():
                        await anyio.sleep(0.05)
                request_scale(tmp_path, {"nope": 2})  # a mistake is written back, the engine goes on
                with anyio.fail_after(20):
                    while not (tmp_path / FAILED).exists():
                        await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
            return engine._session.deployment.rollout.serving("policy")

    assert anyio.run(main) == [0, 1, 2]
    assert b'"changed":{"policy":[2]}' in (tmp_path / DONE).read_bytes()
    assert "ConfigError: no model 'nope' in this pipeline" in (tmp_path / FAILED).read_text()
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


@pytest.mark.parametrize(
    "args, message",
    [
        (["policy=0"], "expected MODEL=N with N >= 1"),
        (["policy"], "expected MODEL=N"),
        (["missing-dir", "policy=2"], "not a folder"),
    ],
)
def test_flowrl_scale_mistakes_exit_2_with_a_message(tmp_path, capsys, args, message):
    from flowrl._tools.cli import main

    where = [str(tmp_path)] if args[0] != "missing-dir" else [str(tmp_path / "missing")]
    assert main(["scale", *where, *args[-1:]]) == 2
    assert message in capsys.readouterr().err
