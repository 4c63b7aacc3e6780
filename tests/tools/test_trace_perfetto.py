"""The Chrome traces of real runs (an in-process engine, a pipeline) against the Trace Event
Format that ui.perfetto.dev reads: the check is ``_traces.assert_trace_event_format``."""

from __future__ import annotations

import json

import anyio
import numpy as np
from _resume_models import make_engine
from _traces import Complete, Counter, Instant, Metadata, assert_trace_event_format

import flowrl
from flowrl._core.observe.trace import read_trace_file
from flowrl.testing import Scale

INPROCESS = {"pipeline": {"backend": "inprocess"}, "policy_replicas": 1, "ranks": 1}


def _processes(parsed) -> dict[int, str]:
    return {e.pid: e.args["name"] for e in parsed.traceEvents if isinstance(e, Metadata) and e.name == "process_name"}


def test_the_trace_of_an_engine_run_with_overlap_evaluation_and_a_resize_is_one_perfetto_reads(tmp_path):
    engine, _ = make_engine(**INPROCESS, num_episode=4, staleness={"max": 1}, eval_every=2, run_dir=str(tmp_path))
    with engine:
        assert engine.resize("policy", 2) == [1]
        engine.learn()
    parsed = assert_trace_event_format(json.loads((tmp_path / "trace.json").read_text()))
    names = _processes(parsed)
    assert {"engine", "policy", "eval:policy", "learner", "autoscale"} <= set(names.values())
    engine_phases = {
        (e.name, e.tid) for e in parsed.traceEvents if isinstance(e, Complete) and names[e.pid] == "engine"
    }
    assert {("startup", 0), ("rollout", 1), ("train", 0), ("eval", 0)} <= engine_phases  # lane 1: rollouts ahead
    (grow,) = [e for e in parsed.traceEvents if isinstance(e, Instant)]
    assert (names[grow.pid], grow.name, grow.args["before"], grow.args["after"]) == ("autoscale", "grow policy", 1, 2)
    counts = [e.args for e in parsed.traceEvents if isinstance(e, Counter)]
    assert counts == [{"policy": 1.0}, {"policy": 2.0}]
    # the trace read back is the engine's timeline, the resize a span of no length
    assert sorted((s.group, s.name, s.start == s.end) for s in read_trace_file(tmp_path / "trace.json")) == sorted(
        (s.group, s.name, s.start == s.end) for s in engine.spans()
    )


def test_the_trace_of_a_pipeline_run_with_a_grown_and_a_shrunk_pool_is_one_perfetto_reads(tmp_path):
    a = Scale("a", {"num_replicas": 1, "batch_size": 2}, srcs=["x"], dst="a", sleep_s=0.002)
    b = Scale("b", {"num_replicas": 2, "batch_size": 3}, srcs=["a"], dst="b", sleep_s=0.001)
    items = [{"x": np.full(2, float(i))} for i in range(24)]

    async def main() -> flowrl.PipelineStats:
        async with flowrl.open_pipeline(lambda x: b.forward_step(a.forward_step(x)), {"backend": "inprocess"}) as pipe:
            await pipe.run(items)
            await pipe.resize("a", 3)
            await pipe.resize("b", 1)
            await pipe.run(items)
            pipe.write_trace(tmp_path / "trace.json")
            return pipe.stats()

    stats = anyio.run(main)
    parsed = assert_trace_event_format(json.loads((tmp_path / "trace.json").read_text()))
    names = _processes(parsed)
    spans = [e for e in parsed.traceEvents if isinstance(e, Complete)]
    assert len(spans) == stats["a.forward_step"].calls + stats["b.forward_step"].calls  # a slice per shard
    marks = [
        (names[e.pid], e.name, e.args["before"], e.args["after"]) for e in parsed.traceEvents if isinstance(e, Instant)
    ]
    assert marks == [("autoscale", "grow a", 1, 3), ("autoscale", "shrink b", 2, 1)]
    assert [e.args for e in parsed.traceEvents if isinstance(e, Counter)] == [
        {"a": 1.0},
        {"a": 3.0},
        {"b": 2.0},
        {"b": 1.0},
    ]
