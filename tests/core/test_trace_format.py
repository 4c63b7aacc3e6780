"""Chrome traces (sans-IO): tracks named per model and replica, and a round trip."""

from __future__ import annotations

import json

from flowrl._core.trace import Span, chrome_trace, read_chrome_trace


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


def test_read_chrome_trace_names_the_event_and_the_field_it_refuses():
    import pytest

    from flowrl import ConfigError

    spans = [Span(group="policy", lane=0, name="policy.forward_step", start=1.0, end=2.0, args={"samples": 4})]
    trace = json.loads(json.dumps(chrome_trace(spans)))
    (x,) = [i for i, e in enumerate(trace["traceEvents"]) if e["ph"] == "X"]
    for key, value, message in [
        ("dur", float("nan"), rf"run/trace.json is not a flowrl trace: .* - at `\$.traceEvents\[{x}\].dur`"),
        ("ts", -5.0, rf"Expected `float` >= 0.0 - at `\$.traceEvents\[{x}\].ts`"),
        ("pid", 7, rf"traceEvents\[{x}\].pid: 7 is named by no process_name event"),
        ("args", {"samples": -1}, rf"traceEvents\[{x}\].args.samples: expected a count of samples, got -1"),
    ]:
        bad = json.loads(json.dumps(trace))
        bad["traceEvents"][x][key] = value
        with pytest.raises(ConfigError, match=message):
            read_chrome_trace(bad, "run/trace.json")
