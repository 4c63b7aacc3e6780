"""Pipeline timelines and counters: a Chrome trace with a span per shard (sample ids, size) and
spans of one replica that never overlap; queue depth, its peak, starved and blocked time."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from _traces import assert_no_overlap, trace_tracks

import flowrl
from flowrl.testing import Scale

CPU = {"cpus_per_replica": 0.1}


@pytest.mark.parametrize("backend", ["ray", "inprocess"])
def test_pipeline_trace_has_a_span_per_shard_with_its_ids_and_no_overlap_per_replica(ray_cluster, tmp_path, backend):
    a = Scale(
        "a",
        {"num_replicas": 3, "batch_size": 3, "prefetch": 2, **CPU},
        srcs=["x"],
        dst="a",
        sleep_s=0.004,
        jitter_seed=1,
    )
    b = Scale("b", {"num_replicas": 2, "batch_size": 4, **CPU}, srcs=["a"], dst="b", sleep_s=0.002)

    def flow(x):
        return b.forward_step(a.forward_step(x))

    with flowrl.Pipeline(flow, {"backend": backend}) as pipe:
        pipe.run([{"x": np.full(2, float(i))} for i in range(60)])
        stats = pipe.stats()
    trace = json.loads(pipe.write_trace(tmp_path / "trace.json").read_text())
    tracks = trace_tracks(trace)
    assert set(tracks) <= {("a", r) for r in range(3)} | {("b", r) for r in range(2)}
    for model, stage in (("a", "a.forward_step"), ("b", "b.forward_step")):
        events = [e for (m, _), evs in tracks.items() if m == model for e in evs]
        assert len(events) == stats[stage].calls  # a span per shard
        assert all(e["name"] == stage and e["args"]["samples"] == len(e["args"]["ids"]) for e in events)
        assert Counter(i for e in events for i in e["args"]["ids"]) == Counter(range(60))  # every sample once
        for (m, r), evs in tracks.items():
            if m == model:
                assert len(evs) == stats[stage].replicas[r].calls
    assert_no_overlap(tracks)


def test_queue_depth_its_peak_and_starved_time_are_counted():
    a = Scale("a", {"num_replicas": 1, "batch_size": 1, "prefetch": 1}, srcs=["x"], dst="a", sleep_s=0.02)
    # guided takes what is pending at once (the cost splitter would let a few gather: its own test)
    b = Scale("b", {"num_replicas": 2, "batch_size": 4, "splitter": "guided"}, srcs=["a"], dst="b")
    with flowrl.Pipeline(lambda x: b.forward_step(a.forward_step(x)), {"backend": "inprocess"}) as pipe:
        pipe.run([{"x": np.full(1, float(i))} for i in range(10)])
        stats = pipe.stats()
    first, second = stats["a.forward_step"], stats["b.forward_step"]
    assert first.queue_peak == 9 and first.queued == 0  # one replica taking one sample at a time
    assert second.queued == 0 and second.queue_peak <= 1
    # b waits for a's shards of 20 ms: its replicas are starved at least that long, a's hardly
    assert all(r.starved_s >= 0.02 for r in second.replicas)
    assert first.replicas[0].starved_s < 0.02
    assert all(r.busy_s + r.starved_s <= stats.active_s + 0.05 for r in (*first.replicas, *second.replicas))


def test_blocked_time_counts_admission_waiting_for_a_full_window():
    import anyio

    double = Scale("double", {"num_replicas": 2, "batch_size": 2}, srcs=["x"], dst="y")

    async def main() -> tuple[float, float]:
        async with flowrl.open_pipeline(
            lambda x: double.forward_step(x), {"backend": "inprocess", "max_inflight": 4, "input_chunk": 4}
        ) as pipe:
            taken = 0
            async for _ in pipe.stream([{"x": np.full(1, float(i))} for i in range(12)]):
                taken += 1
                if taken == 4:  # the window is full: admission waits while this consumer dawdles
                    await anyio.sleep(0.2)
            held = pipe.stats().blocked_s
        async with flowrl.open_pipeline(lambda x: double.forward_step(x), {"backend": "inprocess"}) as pipe:
            await pipe.run([{"x": np.full(1, float(i))} for i in range(12)])
            free = pipe.stats().blocked_s
        return held, free

    held, free = anyio.run(main)
    assert held >= 0.15 and free < 0.05
