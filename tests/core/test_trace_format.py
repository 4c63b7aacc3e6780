"""Chrome traces (sans-IO): tracks named per model and replica, and a round trip."""

from __future__ import annotations

import json

from _traces import run_spans

from flowrl._core.observe.trace import Span, chrome_trace, read_chrome_trace


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
        ("ph", "i", None),  # an instant reads as a span of no length
    ]:
        bad = json.loads(json.dumps(trace))
        bad["traceEvents"][x][key] = value
        if message is None:
            (span,) = read_chrome_trace(bad, "run/trace.json")
            assert span.start == span.end == 1.0
            continue
        with pytest.raises(ConfigError, match=message):
            read_chrome_trace(bad, "run/trace.json")
    bad = json.loads(json.dumps(trace))
    bad["traceEvents"][x] |= {"ph": "i", "ts": None}
    with pytest.raises(ConfigError, match=rf"traceEvents\[{x}\]: an instant needs ts"):
        read_chrome_trace(bad, "run/trace.json")


def test_a_run_with_every_kind_of_span_is_a_trace_perfetto_reads():
    from _traces import Complete, Counter, Instant, Metadata, assert_trace_event_format

    trace = chrome_trace(run_spans())
    parsed = assert_trace_event_format(trace)
    threads = {e.args["name"] for e in parsed.traceEvents if isinstance(e, Metadata) and e.name == "thread_name"}
    assert threads == {"phases", "phases[1]", "phases[2]", "policy[0]", "policy[1]", "trainer[0]", "autoscale[0]"}
    kinds = [type(e) for e in parsed.traceEvents]
    assert kinds.count(Complete) == 8 and kinds.count(Instant) == 2
    # the pool's size as a counter: 1 from the start (startup, at 100 s), 2 from 105 s, 1 from 107.5 s
    steps = [(e.ts, e.args) for e in parsed.traceEvents if isinstance(e, Counter)]
    assert steps == [(0.0, {"policy": 1.0}), (5e6, {"policy": 2.0}), (7.5e6, {"policy": 1.0})]
    instants = [e for e in parsed.traceEvents if isinstance(e, Instant)]
    assert [(e.name, e.s, e.ts) for e in instants] == [("grow policy", "p", 5e6), ("shrink policy", "p", 7.5e6)]


def test_scale_events_read_back_as_spans_of_no_length():
    spans = run_spans()
    back = read_chrome_trace(json.loads(json.dumps(chrome_trace(spans))))
    key = lambda s: (s.start, s.group, s.lane, s.name)  # noqa: E731
    assert sorted(back, key=key) == sorted(spans, key=key)
    assert [s.name for s in back if s.start == s.end] == ["grow policy", "shrink policy"]


def test_numbers_json_cannot_hold_are_written_as_strings():
    from _traces import assert_trace_event_format

    spans = [
        Span(
            group="policy", lane=0, name="s", start=0.0, end=1.0, args={"loss": float("nan"), "m": [1.5, float("inf")]}
        )
    ]
    trace = chrome_trace(spans)
    assert_trace_event_format(trace)
    (x,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert x["args"] == {"loss": "nan", "m": [1.5, "inf"]}


def test_the_format_check_refuses_what_perfetto_would_not_draw():
    """The check is not vacuous: each break of the format is found (and named)."""
    import pytest
    from _traces import assert_trace_event_format

    good = chrome_trace(run_spans())
    assert_trace_event_format(good)
    x = next(i for i, e in enumerate(good["traceEvents"]) if e["ph"] == "X" and e["name"] == "policy.forward_step")
    c = next(i for i, e in enumerate(good["traceEvents"]) if e["ph"] == "C")
    names = [i for i, e in enumerate(good["traceEvents"]) if e["name"] == "thread_name"]
    startup = next(i for i, e in enumerate(good["traceEvents"]) if e["name"] == "startup")
    breaks = [
        (lambda t: t["traceEvents"][x].update(dur=-1.0), "Expected `float` >= 0"),
        (lambda t: t["traceEvents"][x].update(ts=float("nan")), "Out of range float values are not JSON compliant"),
        (lambda t: t["traceEvents"][x].update(pid="1"), "Expected `int`, got `str`"),
        (lambda t: t["traceEvents"][x].pop("dur"), "missing required field `dur`"),
        (lambda t: t["traceEvents"][x].update(ph="Q"), "Invalid value 'Q'"),
        (lambda t: t.update(displayTimeUnit="ms"), "older Perfetto versions misread times"),
        (lambda t: t["traceEvents"][c]["args"].update(policy="two"), "Expected `float`, got `str`"),
        (lambda t: [t["traceEvents"].pop(i) for i in reversed(names)], "no thread_name"),
        # startup (0 to 4 s) stretched to 5 s, into the first rollout (4 to 6 s) on the same thread
        (lambda t: t["traceEvents"][startup].update(dur=5e6), "half-overlaps"),
    ]
    for edit, message in breaks:
        bad = json.loads(json.dumps(good))
        edit(bad)
        with pytest.raises((AssertionError, ValueError), match=message):
            assert_trace_event_format(bad)
