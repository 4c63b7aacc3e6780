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
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from .errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

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


# The engine keeps 200,000 spans (Timeline's limit): with shards of a few hundred ids that is
# ~300 MiB of JSON. A larger file is not a flowrl trace, and decoding it would take GBs of memory.
MAX_TRACE_BYTES = 512 << 20
MAX_EVENTS = 2_000_000
MAX_LANES = 1 << 20  # replicas or ranks of one model
# microseconds: 10**15 is 31 years, which every real timeline is shorter than; a bound keeps sums finite
_Micros = Annotated[float, msgspec.Meta(ge=0, le=1e15)]
_Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_LANES)]


class _Event(msgspec.Struct, frozen=True, kw_only=True):
    """One Chrome trace event as ``chrome_trace`` writes it: "M" names a process or thread, "X" is a span
    (other phases are left alone)."""

    ph: str
    name: str = ""
    cat: str = ""
    pid: _Id = 0
    tid: _Id = 0
    ts: _Micros | None = None
    dur: _Micros | None = None
    args: dict[str, Any] = {}


class _Other(msgspec.Struct, frozen=True, kw_only=True):
    origin_unix_s: Annotated[float, msgspec.Meta(ge=-1e12, le=1e12)] = 0.0


class _Trace(msgspec.Struct, frozen=True, kw_only=True):
    traceEvents: Annotated[list[_Event], msgspec.Meta(max_length=MAX_EVENTS)]  # noqa: N815 (Chrome's name)
    otherData: _Other = _Other()  # noqa: N815
    displayTimeUnit: str = "ms"  # noqa: N815


def read_trace_file(path: str | Path, max_bytes: int = MAX_TRACE_BYTES) -> list[Span]:
    """The spans of the trace file at ``path``; a ConfigError names the file, and the event and field
    for a malformed one."""
    path = Path(path)
    if not path.is_file():  # a FIFO or a device would block or never end
        raise ConfigError(f"no trace at {path} (an engine writes one when RunConfig.run_dir is set)")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise ConfigError(f"{path}: {size} bytes, larger than {max_bytes}; not a flowrl trace")
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({type(err).__name__}: {err.strerror or err})") from err
    try:
        trace = msgspec.json.decode(raw, type=_Trace)
    except msgspec.ValidationError as err:
        raise ConfigError(f"{path} is not a flowrl trace: {err}") from err
    except msgspec.DecodeError as err:
        raise ConfigError(f"{path} is not a flowrl trace: not JSON: {err}") from err
    except RecursionError as err:  # msgspec's own bound on nesting
        raise ConfigError(f"{path} is not a flowrl trace: nested too deeply") from err
    return _spans(trace, str(path))


def read_chrome_trace(data: Mapping[str, Any], where: str = "trace") -> list[Span]:
    """The spans of a trace written by ``chrome_trace``, given as decoded JSON."""
    try:
        trace = msgspec.convert(data, _Trace)
    except msgspec.ValidationError as err:
        raise ConfigError(f"{where} is not a flowrl trace: {err}") from err
    return _spans(trace, where)


def _spans(trace: _Trace, where: str) -> list[Span]:
    names: dict[int, str] = {}
    for i, e in enumerate(trace.traceEvents):
        if e.ph == "M" and e.name == "process_name":
            name = e.args.get("name")
            if not isinstance(name, str):
                raise ConfigError(f"{where}: traceEvents[{i}].args.name: expected the process's name, got {name!r:.80}")
            names[e.pid] = name
    origin = trace.otherData.origin_unix_s
    return [_span(i, e, names, origin, where) for i, e in enumerate(trace.traceEvents) if e.ph == "X"]


def _span(i: int, e: _Event, names: dict[int, str], origin: float, where: str) -> Span:
    at = f"{where}: traceEvents[{i}]"
    if e.ts is None or e.dur is None:
        raise ConfigError(f"{at}: a complete event (ph X) needs ts and dur")
    if e.pid not in names:
        raise ConfigError(f"{at}.pid: {e.pid} is named by no process_name event")
    samples = e.args.get("samples", 0)
    if type(samples) is not int or not 0 <= samples <= MAX_EVENTS << 20:
        raise ConfigError(f"{at}.args.samples: expected a count of samples, got {samples!r:.80}")
    return Span(
        group=names[e.pid],
        lane=e.tid,
        name=e.name,
        start=origin + e.ts / 1e6,
        end=origin + (e.ts + e.dur) / 1e6,
        args=e.args,
    )


def write_json(path: str | Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path
