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
