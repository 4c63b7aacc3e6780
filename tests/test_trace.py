"""Timelines: a Chrome trace with a span per shard (sample ids, size), spans of one replica that
never overlap, episode phases and trainer steps; the run directory's metrics lines."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import numpy as np
import pytest

import flowrl
from flowrl._core.trace import Span, chrome_trace, read_chrome_trace
from flowrl.testing import CountingTrainer, Scale, flowrl_actor_names

CPU = {"cpus_per_replica": 0.1}


def _tracks(trace: dict) -> dict[tuple[str, int], list[dict]]:
    """Complete events per (process name, thread id), in start order."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks[(names[e["pid"]], e["tid"])].append(e)
    return {k: sorted(v, key=lambda e: e["ts"]) for k, v in tracks.items()}


def _assert_no_overlap(tracks: dict) -> None:
    for key, events in tracks.items():
        for a, b in zip(events, events[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (key, a, b)  # microseconds, rounded to 1 ns


def test_chrome_trace_names_tracks_and_round_trips():
    spans = [
        Span(group="policy", lane=1, name="policy.forward_step", start=10.0, end=10.5, args={"ids": [3, 4]}),
        Span(group="engine", lane=0, name="rollout", start=9.5, end=11.0, args={"episode": 0}),
    ]
    trace = chrome_trace(spans)
    meta = {(e["name"], e["args"].get("name")) for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {("process_name", "engine"), ("process_name", "policy"), ("thread_name", "policy[1]")} <= meta
    x = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"]) for e in x] == [("rollout", 0.0, 1.5e6), ("policy.forward_step", 5e5, 5e5)]
    assert sorted(read_chrome_trace(json.loads(json.dumps(trace))), key=lambda s: s.start) == sorted(
        spans, key=lambda s: s.start
    )


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
    tracks = _tracks(trace)
    assert set(tracks) <= {("a", r) for r in range(3)} | {("b", r) for r in range(2)}
    for model, stage in (("a", "a.forward_step"), ("b", "b.forward_step")):
        events = [e for (m, _), evs in tracks.items() if m == model for e in evs]
        assert len(events) == stats[stage].calls  # a span per shard
        assert all(e["name"] == stage and e["args"]["samples"] == len(e["args"]["ids"]) for e in events)
        assert Counter(i for e in events for i in e["args"]["ids"]) == Counter(range(60))  # every sample once
        for (m, r), evs in tracks.items():
            if m == model:
                assert len(evs) == stats[stage].replicas[r].calls
    _assert_no_overlap(tracks)


def test_engine_trace_and_metrics_lines_match_its_counters(ray_cluster, tmp_path):
    policy = Scale("policy", {"num_replicas": 2, "batch_size": 2, **CPU}, srcs=["x"], dst="y", sleep_s=0.002)
    trainer = CountingTrainer("trainer", {"num_replicas": 2, **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={"sample_per_episode": 8, "num_episode": 3, "train_global_batch_size": 4, "run_dir": str(tmp_path)},
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(32)])
    stats = engine.learn()
    assert flowrl_actor_names() == []
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["episode"] for line in lines] == [0, 1, 2]
    for line, episode in zip(lines, stats.episodes):
        assert line["samples"] == episode.samples == 8 and line["weight_versions"] == episode.weight_versions
        assert line["rollout_s"] == pytest.approx(episode.rollout_s)
    last = lines[-1]
    assert last["rollout"]["policy.forward_step"]["samples"] == stats.rollout["policy.forward_step"].samples == 24
    assert last["trainers"]["trainer"]["steps"] == stats.trainers["trainer"].steps == 6
    tracks = _tracks(json.loads((tmp_path / "trace.json").read_text()))
    phases = [(e["name"], e["args"]["episode"]) for e in tracks[("engine", 0)]]
    assert phases == [(p, e) for e in range(3) for p in ("rollout", "train", "sync")]
    for rank in (0, 1):  # a span per step and rank, with the rank's sample ids
        steps = tracks[("trainer", rank)]
        assert len(steps) == 6 and all(e["name"] == "train_step" and e["args"]["ids"] for e in steps)
    assert sum(len(e["args"]["ids"]) for rank in (0, 1) for e in tracks[("trainer", rank)]) == 24
    assert sum(len(e["args"]["ids"]) for r in (0, 1) for e in tracks.get(("policy", r), [])) == 24
    _assert_no_overlap(tracks)


def test_flowrl_trace_prints_a_summary_and_draws_the_chart(ray_cluster, tmp_path, capsys):
    from flowrl._tools.cli import main

    policy = Scale("policy", {"num_replicas": 2, "batch_size": 2, **CPU}, srcs=["x"], dst="y", sleep_s=0.002)
    trainer = CountingTrainer("trainer", {"num_replicas": 1, **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        config={"sample_per_episode": 8, "num_episode": 2, "run_dir": str(tmp_path)},
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(16)])
    stats = engine.learn()
    assert main(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[3:] if line.strip() and not line.startswith("chart")}
    assert set(rows) == {"engine", "policy", "trainer"}
    assert rows["policy"][1:4] == ["2", str(stats.rollout["policy.forward_step"].calls), "16"]  # lanes, spans, samples
    assert rows["trainer"][1:4] == ["1", "2", "16"] and rows["engine"][2] == "4"  # 2 x (rollout, train)
    png = tmp_path / "timeline.png"
    assert out[-1] == f"chart: {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flowrl_trace_names_what_is_missing(tmp_path, capsys):
    from flowrl._tools.cli import main

    assert main(["trace", str(tmp_path)]) == 2
    assert f"no trace at {tmp_path / 'trace.json'}" in capsys.readouterr().err
    (tmp_path / "trace.json").write_text('{"not": "a trace"}')
    assert main(["trace", str(tmp_path), "--no-png"]) == 2
    assert "is not a flowrl trace (KeyError" in capsys.readouterr().err


def test_debug_switch_runs_a_ray_configured_engine_in_this_process(monkeypatch):
    import os

    class Where(Scale):
        def forward_step(self, batch, iteration):  # breakpoint() here would stop in this process
            return {**super().forward_step(batch, iteration), "pid": [os.getpid()] * len(batch)}

    monkeypatch.setenv("FLOWRL_DEBUG", "1")
    policy = Where("policy", {"num_replicas": 3, "batch_size": 2, **CPU}, srcs=["x"], dst="y")
    trainer = CountingTrainer("trainer", {"num_replicas": 2, **CPU})  # one rank while debugging
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={"sample_per_episode": 8, "num_episode": 2, "pipeline": {"backend": "ray"}},
    )
    pids = []
    engine.set_relay_sample_fn(
        lambda episodes: pids.extend(s["pid"] for s in episodes[-1].buffer) or episodes[-1].buffer
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(16)])
    stats = engine.learn()
    assert set(pids) == {os.getpid()} and len(pids) == 16
    assert stats.trainers["trainer"].samples == 16 and [r.rank for r in stats.trainers["trainer"].ranks] == [0]


def test_episode_counters_reach_a_prometheus_scrape_of_the_ray_cluster(ray_cluster):
    import re
    import time
    import urllib.request

    policy = Scale("prom_policy", {"num_replicas": 2, "batch_size": 2, **CPU}, srcs=["x"], dst="y")
    trainer = CountingTrainer("prom_trainer", {"num_replicas": 1, **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x), train=[trainer], config={"sample_per_episode": 8, "num_episode": 2}
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(16)])
    stats = engine.learn()
    port = ray_cluster._private.worker._global_node.metrics_export_port
    assert isinstance(port, int), "Ray's metrics agent is not running: install flowrl[metrics] (ray[default])"
    wanted = {
        "ray_flowrl_stage_samples": ('stage="prom_policy.forward_step"', 16.0),
        "ray_flowrl_trainer_steps": ('trainer="prom_trainer"', float(stats.trainers["prom_trainer"].steps)),
    }
    seen: dict[str, float] = {}
    deadline = time.monotonic() + 60  # Ray's agent exports every few seconds
    while time.monotonic() < deadline and len(seen) < len(wanted):
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for name, (tag, _) in wanted.items():
            found = re.search(rf"^{name}{{[^}}]*{re.escape(tag)}[^}}]*}} (\S+)$", body, re.M)
            if found:
                seen[name] = float(found.group(1))
        if len(seen) < len(wanted):
            time.sleep(1)  # polling an HTTP endpoint that refreshes on its own clock
    assert seen == {name: value for name, (_, value) in wanted.items()}


def test_queue_depth_its_peak_and_starved_time_are_counted():
    a = Scale("a", {"num_replicas": 1, "batch_size": 1, "prefetch": 1}, srcs=["x"], dst="a", sleep_s=0.02)
    b = Scale("b", {"num_replicas": 2, "batch_size": 4}, srcs=["a"], dst="b")
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


def test_staleness_counts_how_many_versions_behind_each_trained_sample_was_generated():
    policy = Scale("policy", {"num_replicas": 2, "batch_size": 2}, srcs=["x"], dst="y")
    trainer = CountingTrainer("trainer")
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={
            "sample_per_episode": 4,
            "num_episode": 3,
            "max_relay_episode": 2,
            "pipeline": {"backend": "inprocess"},
        },
    )
    engine.set_relay_sample_fn(lambda episodes: [s for e in episodes for s in e.buffer])  # brings the last one back
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(16)])
    stats = engine.learn()
    assert [e.staleness for e in stats.episodes] == [
        {"policy": {0: 4}},
        {"policy": {0: 4, 1: 4}},
        {"policy": {0: 4, 1: 4}},
    ]


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
