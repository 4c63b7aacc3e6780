"""Elastic pipelines on a real local Ray cluster (and in process): replicas added and removed
mid-run, a replica removed mid-shard, one that cannot join, and the autoscaler within its limits."""

from __future__ import annotations

from collections import Counter

import anyio
import numpy as np
import pytest

import flowrl
from flowrl._backends.select import make_backend
from flowrl._pipeline.opening import build_flow, running
from flowrl._pipeline.parts import Joining
from flowrl.testing import Scale, flowrl_actor_names

STAGE = "m.forward_step"
CPU = {"cpus_per_replica": 0.1}


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
    assert [e.recovery_s for e in events] == [None, None]  # resizes asked for replace nothing
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

    refusing = [True]

    async def refuse(handle):  # what an engine's weight hand-over does when it fails
        if refusing[0]:
            raise flowrl.StageError("no weights for it", "m.set_weights", handle.replica_id, [])

    async def main():
        config = flowrl.PipelineConfig(progress="off")
        graph, backend = build_flow(lambda x: m.forward_step(x)), make_backend(config)
        try:
            async with running(graph, backend, config, joining=Joining(prepare=refuse)) as pipe:
                return await grow(pipe)
        finally:
            await backend.close()

    async def grow(pipe):
        with pytest.raises(flowrl.StageError, match="no weights for it"):
            await pipe.add_replicas("m", 2)
        names = flowrl_actor_names()
        refusing[0] = False
        assert await pipe.add_replicas("m", 1) == [3]  # ids are never reused, not even a failed join's
        assert pipe.serving("m") == [0, 3]
        samples = await pipe.run([{"x": np.ones(1)} for _ in range(16)])
        return names, samples, pipe.stats()

    names, samples, stats = anyio.run(main)
    assert sum(1 for n in names if "-m-" in n) == 1  # the two that could not join are gone already
    replicas = stats.stages["m.forward_step"].replicas
    assert len(samples) == 16 and {r.replica for r in replicas if r.samples} <= {0, 3}
    assert [(r.replica, r.samples, r.idle_s) for r in replicas if r.replica in (1, 2)] == [(1, 0, 0.0), (2, 0, 0.0)]
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
