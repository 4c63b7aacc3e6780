"""Reading Chrome traces in tests (shared by the pipeline, engine and trace-view tests), and a
check of a trace against the Trace Event Format that ui.perfetto.dev reads."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from typing import Annotated, Any, Literal

import msgspec

from flowrl._core.observe.trace import Span


def trace_tracks(trace: dict) -> dict[tuple[str, int], list[dict]]:
    """Complete events per (process name, thread id), in start order."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks[(names[e["pid"]], e["tid"])].append(e)
    return {k: sorted(v, key=lambda e: e["ts"]) for k, v in tracks.items()}


def assert_no_overlap(tracks: dict) -> None:
    for key, events in tracks.items():
        for a, b in itertools.pairwise(events):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (key, a, b)  # microseconds, rounded to 1 ns


def scale_event(model: str, at: float, before: int, after: int) -> Span:
    action = "grow" if after > before else "shrink"
    return Span(
        group="autoscale",
        lane=0,
        name=f"{action} {model}",
        start=at,
        end=at,
        args={"before": before, "after": after, "reason": "requested"},
    )


def run_spans() -> list[Span]:
    """An engine's timeline in small: startup, two episodes' phases, two replicas, a trainer, resizes."""
    spans = [
        Span(group="engine", lane=0, name="startup", start=100.0, end=104.0),
        Span(group="engine", lane=0, name="rollout", start=104.0, end=106.0, args={"episode": 0}),
        Span(group="engine", lane=0, name="train", start=106.0, end=107.0, args={"episode": 0}),
        Span(group="engine", lane=1, name="rollout", start=106.5, end=108.0, args={"episode": 1}),
        Span(group="engine", lane=2, name="sync", start=107.0, end=107.25, args={"episode": 0}),
        Span(
            group="trainer", lane=0, name="train_step", start=106.1, end=106.9, args={"samples": 4, "ids": [0, 1, 2, 3]}
        ),
        scale_event("policy", 105.0, 1, 2),
        scale_event("policy", 107.5, 2, 1),
    ]
    for r, (start, end) in enumerate([(104.0, 105.9), (105.0, 106.0)]):
        spans.append(
            Span(group="policy", lane=r, name="policy.forward_step", start=start, end=end, args={"samples": 2})
        )
    return spans


# The Trace Event Format (JSON object form), for the phases flowrl writes; unknown fields and
# phases are refused, so a new kind of event must be added here on purpose.
Micros = Annotated[float, msgspec.Meta(ge=0)]
Int = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # Perfetto keeps pid and tid as 32-bit ints


class _Base(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="ph"):
    name: str
    pid: Int
    tid: Int


class Complete(_Base, tag="X"):
    ts: Micros
    dur: Micros
    cat: str = ""
    args: dict[str, Any] = {}


class Instant(_Base, tag="i"):
    ts: Micros
    s: Literal["g", "p", "t"] = "t"
    cat: str = ""
    args: dict[str, Any] = {}


class Counter(_Base, tag="C"):
    ts: Micros
    args: dict[str, float]  # a series per key: numbers only
    cat: str = ""


class Metadata(_Base, tag="M"):
    name: Literal["process_name", "thread_name", "process_sort_index", "thread_sort_index", "process_labels"]
    args: dict[str, Any]


class TraceFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    traceEvents: list[Complete | Instant | Counter | Metadata]  # noqa: N815 (the format's names)
    displayTimeUnit: Literal["ms", "ns"] = "ms"  # noqa: N815
    otherData: dict[str, Any] = {}  # noqa: N815


def assert_trace_event_format(trace: dict[str, Any]) -> TraceFile:
    """Fail unless ``trace`` is a Trace Event Format file Perfetto draws as flowrl means it: the
    schema above over strict JSON (no NaN or infinity anywhere), named processes and threads, and
    the complete events of each thread nested (Perfetto drops a slice that half-overlaps another)."""
    # the format allows displayTimeUnit as a display preference, but Perfetto's trace processor read
    # ts and dur in that unit in earlier versions: "ms" there made every time 1,000 times too long
    assert "displayTimeUnit" not in trace, "displayTimeUnit: older Perfetto versions misread times with it"
    raw = json.dumps(trace, allow_nan=False).encode()  # ValueError on NaN or inf
    parsed = msgspec.json.decode(raw, type=TraceFile)  # ValidationError names the event and field
    meta = [e for e in parsed.traceEvents if isinstance(e, Metadata)]
    for e in meta:
        want = {"process_name": str, "thread_name": str, "process_labels": str}.get(e.name, int)
        key = "sort_index" if e.name.endswith("sort_index") else "name" if e.name != "process_labels" else "labels"
        assert set(e.args) == {key} and type(e.args[key]) is want, e
    processes = {e.pid for e in meta if e.name == "process_name"}
    threads = {(e.pid, e.tid) for e in meta if e.name == "thread_name"}
    for e in parsed.traceEvents:
        assert e.pid in processes, f"no process_name for {e}"
        assert not isinstance(e, (Complete, Instant)) or (e.pid, e.tid) in threads, f"no thread_name for {e}"
    spans = defaultdict(list)
    for e in parsed.traceEvents:
        if isinstance(e, Complete):
            spans[(e.pid, e.tid)].append(e)
    for events in spans.values():
        _assert_nested(events)
    return parsed


def _assert_nested(events: list[Complete]) -> None:
    open_ends: list[float] = []  # the ends of the slices that contain the current one
    for e in sorted(events, key=lambda e: (e.ts, -e.dur)):
        while open_ends and open_ends[-1] <= e.ts + 1e-3:  # rounded to 1 ns: touching is fine
            open_ends.pop()
        assert not open_ends or e.ts + e.dur <= open_ends[-1] + 1e-3, f"{e} half-overlaps an earlier slice"
        open_ends.append(e.ts + e.dur)
