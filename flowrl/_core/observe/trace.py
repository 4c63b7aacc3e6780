"""Timelines (sans-IO): spans of replicas, trainer ranks and episode phases, written
as a Chrome trace (``chrome://tracing`` and https://ui.perfetto.dev open it).

A shard's span is its step as the replica timed it (wall clock, in the replica's process):
a replica runs one step at a time, so the spans of one replica never overlap, whatever the
stage. Clocks of different nodes are not aligned beyond what the OS keeps them.
"""

from __future__ import annotations

import json
import math
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from ..errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

ENGINE = "engine"
SCALE = "autoscale"  # the group of the instants that mark a pool resized


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

    def shard(
        self, model: str, replica: int, stage: str, started: float, step_s: float, ids: list[int], turns: Any = None
    ) -> None:
        """A shard's step; ``turns``: inside a loop, each sample's turn."""
        if turns is None:
            self.add(model, replica, stage, started, started + step_s, samples=len(ids), ids=ids)
        else:
            self.add(model, replica, stage, started, started + step_s, samples=len(ids), ids=ids, turns=turns)

    @property
    def spans(self) -> list[Span]:
        return list(self._spans) if self.limit else []


def lane_label(group: str, lane: int) -> str:
    """A track's name: ``policy[1]`` for replica 1; the engine's ``phases``, and ``phases[1]`` for
    the lanes of work overlapped with them (rollouts ahead, background syncs)."""
    if group == ENGINE:
        return "phases" if lane == 0 else f"phases[{lane}]"
    return f"{group}[{lane}]"


def is_scale_event(span: Span) -> bool:
    """Whether ``span`` marks a pool resized (an instant of the ``autoscale`` group, or ``eval:autoscale``)."""
    return span.group.rpartition(":")[2] == SCALE


def chrome_trace(spans: Iterable[Span]) -> dict[str, Any]:
    """``spans`` as a Chrome trace (the Trace Event Format's JSON object form): a process per model
    (the engine first), a thread per replica or rank, a complete event ("X") per span, an instant
    ("i") and a ``replicas`` counter step ("C") per scale event, times in microseconds."""
    spans = sorted(spans, key=lambda s: s.start)
    groups = sorted({s.group for s in spans}, key=lambda g: (g != ENGINE, g))
    pid = {g: i + 1 for i, g in enumerate(groups)}
    events: list[dict[str, Any]] = []
    for g in groups:
        events += _names(g, pid[g], sorted({s.lane for s in spans if s.group == g}))
    origin = spans[0].start if spans else 0.0
    counted: set[str] = set()
    for s in spans:
        # start and end rounded, the duration their difference: spans that touch still touch
        start, end = round((s.start - origin) * 1e6, 3), round((max(s.end, s.start) - origin) * 1e6, 3)
        where = {"name": s.name, "cat": s.group, "pid": pid[s.group], "tid": s.lane, "ts": start}
        if is_scale_event(s):
            events.append({"ph": "i", "s": "p", **where, "args": _finite(s.args)})
            events += _replicas(s, pid[s.group], start, counted)
        else:
            events.append({"ph": "X", **where, "dur": round(end - start, 3), "args": _finite(s.args)})
    # no displayTimeUnit: older Perfetto trace processors read ts and dur in that unit, not in µs
    return {"traceEvents": events, "otherData": {"origin_unix_s": origin}}


def _names(group: str, pid: int, lanes: list[int]) -> list[dict[str, Any]]:
    """The metadata events that name ``group``'s process and its lanes' threads."""
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": group}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    for lane in lanes:
        label = lane_label(group, lane)
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane, "args": {"name": label}})
    return out


def _replicas(s: Span, pid: int, ts: float, counted: set[str]) -> list[dict[str, Any]]:
    """A scale event as steps of its model's ``replicas`` counter (Perfetto draws a counter track
    per model): the size before, at the timeline's start, the first time the model is seen."""
    model = str(s.args.get("model", s.name.rpartition(" ")[2]))  # the span is named "grow policy"
    before, after = s.args.get("before"), s.args.get("after")
    if type(before) is not int or type(after) is not int:
        return []
    step = {"ph": "C", "name": "replicas", "pid": pid, "tid": 0}
    out = [] if model in counted else [{**step, "ts": 0.0, "args": {model: before}}]
    counted.add(model)
    return [*out, {**step, "ts": ts, "args": {model: after}}]


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities spelled as strings: JSON has no such numbers, and Perfetto
    refuses a file that holds them."""
    if type(value) is float:
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not all(type(v) is int for v in value):
        return [_finite(v) for v in value]
    return value


# The engine keeps 200,000 spans (Timeline's limit): with shards of a few hundred ids that is
# ~300 MiB of JSON. A larger file is not a flowrl trace, and decoding it would take GBs of memory.
MAX_TRACE_BYTES = 512 << 20
MAX_EVENTS = 2_000_000
MAX_LANES = 1 << 20  # replicas or ranks of one model
# microseconds: 10**15 is 31 years, which every real timeline is shorter than; a bound keeps sums finite
_Micros = Annotated[float, msgspec.Meta(ge=0, le=1e15)]
_Id = Annotated[int, msgspec.Meta(ge=0, le=MAX_LANES)]


class _Event(msgspec.Struct, frozen=True, kw_only=True):
    """One Chrome trace event as ``chrome_trace`` writes it: "M" names a process or thread, "X" is a span,
    "i" (or "I") an instant, read as a span of no length (other phases are left alone)."""

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
    displayTimeUnit: str = "ms"  # noqa: N815 (traces written before it was left out)


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


_SPANS = frozenset({"X", "i", "I"})  # the phases read as spans


def _spans(trace: _Trace, where: str) -> list[Span]:
    names: dict[int, str] = {}
    for i, e in enumerate(trace.traceEvents):
        if e.ph == "M" and e.name == "process_name":
            name = e.args.get("name")
            if not isinstance(name, str):
                raise ConfigError(f"{where}: traceEvents[{i}].args.name: expected the process's name, got {name!r:.80}")
            names[e.pid] = name
    origin = trace.otherData.origin_unix_s
    return [_span(i, e, names, origin, where) for i, e in enumerate(trace.traceEvents) if e.ph in _SPANS]


def _span(i: int, e: _Event, names: dict[int, str], origin: float, where: str) -> Span:
    at = f"{where}: traceEvents[{i}]"
    dur = 0.0 if e.ph != "X" else e.dur
    if e.ts is None or dur is None:
        raise ConfigError(
            f"{at}: a complete event (ph X) needs ts and dur" if e.ph == "X" else f"{at}: an instant needs ts"
        )
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
        end=origin + (e.ts + dur) / 1e6,
        args=e.args,
    )


def write_json(path: str | Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path
