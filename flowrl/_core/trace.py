"""Timelines (sans-IO): spans of replicas, trainer ranks and episode phases, written
as a Chrome trace (``chrome://tracing`` and https://ui.perfetto.dev open it).

A shard's span is its step as the replica timed it (wall clock, in the replica's process):
a replica runs one step at a time, so the spans of one replica never overlap, whatever the
stage. Clocks of different nodes are not aligned beyond what the OS keeps them.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from collections.abc import Iterable

ENGINE = "engine"


class Span(msgspec.Struct, frozen=True, kw_only=True):
    """One busy interval of a track: ``group`` is a model (or ``"engine"``), ``lane`` a
    replica or rank (0 for the engine), ``start``/``end`` wall-clock seconds."""

    group: str
    lane: int
    name: str
    start: float
    end: float
    args: dict[str, Any] = {}


class Timeline:
    """The last ``limit`` spans of a run (older ones are dropped first; 0 records none)."""

    def __init__(self, limit: int = 200_000) -> None:
        self.limit = limit
        self._spans: deque[Span] = deque(maxlen=limit or 1)

    def add(self, group: str, lane: int, name: str, start: float, end: float, **args: Any) -> None:
        if self.limit:
            self._spans.append(Span(group=group, lane=lane, name=name, start=start, end=end, args=args))

    def shard(self, model: str, replica: int, stage: str, started: float, step_s: float, ids: list[int]) -> None:
        self.add(model, replica, stage, started, started + step_s, samples=len(ids), ids=ids)

    @property
    def spans(self) -> list[Span]:
        return list(self._spans) if self.limit else []


def chrome_trace(spans: Iterable[Span]) -> dict[str, Any]:
    """``spans`` as a Chrome trace: a process per model (the engine first), a thread per
    replica or rank, a complete event ("X") per span, times in microseconds."""
    spans = sorted(spans, key=lambda s: s.start)
    groups = sorted({s.group for s in spans}, key=lambda g: (g != ENGINE, g))
    pid = {g: i + 1 for i, g in enumerate(groups)}
    events: list[dict[str, Any]] = []
    for g in groups:
        events.append({"ph": "M", "name": "process_name", "pid": pid[g], "tid": 0, "args": {"name": g}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid[g], "tid": 0, "args": {"sort_index": pid[g]}}
        )
        for lane in sorted({s.lane for s in spans if s.group == g}):
            label = "phases" if g == ENGINE else f"{g}[{lane}]"
            events.append({"ph": "M", "name": "thread_name", "pid": pid[g], "tid": lane, "args": {"name": label}})
    origin = spans[0].start if spans else 0.0
    for s in spans:
        # start and end rounded, the duration their difference: spans that touch still touch
        start, end = round((s.start - origin) * 1e6, 3), round((max(s.end, s.start) - origin) * 1e6, 3)
        events.append(
            {
                "ph": "X",
                "name": s.name,
                "cat": s.group,
                "pid": pid[s.group],
                "tid": s.lane,
                "ts": start,
                "dur": round(end - start, 3),
                "args": s.args,
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": origin}}


def read_chrome_trace(data: dict[str, Any]) -> list[Span]:
    """The spans of a trace written by ``chrome_trace`` (for ``flowrl trace``)."""
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    origin = data.get("otherData", {}).get("origin_unix_s", 0.0)
    return [
        Span(
            group=names[e["pid"]],
            lane=e["tid"],
            name=e["name"],
            start=origin + e["ts"] / 1e6,
            end=origin + (e["ts"] + e["dur"]) / 1e6,
            args=e.get("args", {}),
        )
        for e in data["traceEvents"]
        if e["ph"] == "X"
    ]


def write_json(path: str | Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path
