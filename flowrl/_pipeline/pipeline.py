"""The stage runtime (layer 5): pullers per replica slot and the join by sample id.

The driver keeps, per sample, where each producer's fields live (object reference, row) and
which stages are done. A stage is offered a sample when all its inputs are done for it; its
pool's slots pull shards cut on demand. Payloads never pass through here, only references.
Runs (admission and delivery) live in ``_runs.py``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from .._backends.specs import ReplicaHandle, ReplicaSpec, default_spec
from .._core.batch import Batch
from .._core.config import CallMeta, Piece, PipelineConfig, ShardCall
from .._core.errors import (
    FlowDefinitionError,
    FlowError,
    InputLostError,
    OutputError,
    PipelineClosedError,
    ReplicaDiedError,
    StageError,
)
from .._core.graph import SOURCE, FlowGraph
from .._core.scheduler import Assignment, PoolScheduler
from .._core.stats import PipelineStats, StatsRecorder
from .._core.trace import Timeline, chrome_trace, write_json
from .membership import ElasticMixin
from .pools import AsyncPool, Retired, Window
from .recovery import RecoveryMixin
from .runs import Loc, Run, StreamingMixin

if TYPE_CHECKING:
    from pathlib import Path

    from anyio.abc import TaskGroup

    from .._backends.abc import Backend
    from .._core.autoscale import ScaleEvent
    from .._core.model import Model


class _SampleState:
    __slots__ = ("loc", "node", "done", "run", "cost")

    def __init__(self, loc: dict[str, Loc], run: Run, cost: float) -> None:
        self.loc = loc
        self.node: dict[str, str] = {}  # stage -> the node its output was made on
        self.done: set[str] = set()
        self.run = run
        self.cost = cost  # its estimate (PipelineConfig.cost_field), else 0


class AsyncPipeline(StreamingMixin, RecoveryMixin, ElasticMixin):
    """A running flow: ``await pipe.run(items)``, ``async for s in pipe.stream(items)``,
    ``pipe.stats()``, ``pipe.placement``. Get one from ``flowrl.open_pipeline``."""

    def __init__(
        self, graph: FlowGraph, backend: Backend, config: PipelineConfig, handles: list[ReplicaHandle]
    ) -> None:
        self.graph = graph
        self.config = config
        self._backend = backend
        self._handles = handles
        self._pools: dict[str, AsyncPool] = {}
        for name, model in graph.models.items():
            sched = PoolScheduler(
                replicas=model.config.replicas, policy=model.config.splitter, prefetch=model.config.prefetch
            )
            for stage in graph.stages_of(name):
                sched.add_stage(stage, model.config.batch_size)
            self._pools[name] = AsyncPool(sched)
        self._recorder = StatsRecorder(
            {s.name: s.model for s in graph.stages.values()}, {n: m.config.replicas for n, m in graph.models.items()}
        )
        self._window = Window(config.max_inflight)
        self._samples: dict[int, _SampleState] = {}
        self._retries: dict[tuple[str, int], int] = {}  # (stage, sample) -> times sent again
        self._fields: dict[str, frozenset[str]] = {}
        self._next_id = 0
        self._runs = 0
        self._run: Run | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._tg: TaskGroup | None = None
        self._begin_lock = anyio.Lock()
        self._recovering = anyio.Lock()
        self.timeline = Timeline(config.trace_spans)  # a span per shard, as its replica timed it
        started = time.perf_counter()  # every replica waits for work from the start
        self._hungry = {(h.model, h.replica_id): started for h in handles}
        # elastic pools (``_elastic``): set by whoever opens the pipeline
        self.grow_spec: Callable[[Model, int], ReplicaSpec] = default_spec
        self.join_hook: Callable[[ReplicaHandle], Awaitable[None]] | None = None
        self.members_lock = anyio.Lock()
        self.scale_events: list[ScaleEvent] = []
        self._slots: dict[tuple[str, int], int] = {}  # (model, replica) -> slots running
        self._left: dict[tuple[str, int], anyio.Event] = {}  # replicas being removed, set once their slots end
        self._resizing = anyio.Lock()

    # ---- lifecycle (driven by open_pipeline) ----
    def _start(self, tg: TaskGroup) -> None:
        self._tg = tg
        for handle in self._handles:
            model = self.graph.models[handle.model]
            for _ in range(model.config.prefetch):
                self._start_slot(handle)
        if any(m.config.autoscale is not None for m in self.graph.models.values()):
            tg.start_soon(self._autoscale)

    def _fail(self, err: BaseException) -> None:
        """Record the first failure and wake consumers that wait outside the task group."""
        if self._error is None:
            self._error = err
        run = self._run
        if run is not None:
            run.send.close()
            run.drained.set()

    def _close(self) -> None:
        self._closed = True

    @property
    def placement(self) -> dict[str, list[str]]:
        """Node id of each replica, per model."""
        out: dict[str, list[str]] = {m: [""] * pool.scheduler.replicas for m, pool in self._pools.items()}
        for h in self._handles:
            out[h.model][h.replica_id] = h.node_id
        return out

    def resume_at(self, next_id: int, next_run: int) -> None:
        """Number the next sample ``next_id`` and the next run (a step's ``iteration``)
        ``next_run``: an engine resuming from a checkpoint continues both."""
        if self._samples or (self._run is not None and not self._run.drained.is_set()):
            raise PipelineClosedError("a pipeline can only be renumbered while no run is in progress")
        self._next_id, self._runs = next_id, next_run
        self._retries.clear()

    def write_trace(self, path: str | Path) -> Path:
        """Write the pipeline's timeline as a Chrome trace (JSON; Perfetto opens it)."""
        return write_json(path, chrome_trace(self.timeline.spans))

    def numbering(self) -> tuple[int, int]:
        """(the next sample's id, the next run's number)."""
        return self._next_id, self._runs

    def replicas_of(self, model: str) -> list[ReplicaHandle]:
        return [h for h in self._handles if h.model == model]

    def busy(self) -> dict[str, tuple[int, int]]:
        """Per model: (replicas running a shard now, replicas serving)."""
        out = {}
        for name, pool in self._pools.items():
            s = pool.scheduler
            serving = [r for r in range(s.replicas) if r not in s.retired]
            out[name] = (sum(1 for r in serving if s.in_flight[r]), len(serving))
        return out

    def _active_now(self) -> float:
        """Seconds of runs so far, the one in progress included."""
        run = self._run
        return self._recorder.active_s + (
            0.0 if run is None or run.active_closed else time.perf_counter() - run.started
        )

    def _running(self) -> bool:
        return self._run is not None and not self._run.drained.is_set()

    def stats(self) -> PipelineStats:
        """Counters so far; a stream in progress counts its time up to now."""
        run = self._run
        live = 0.0 if run is None or run.active_closed else time.perf_counter() - run.started
        queues = {stage: q for pool in self._pools.values() for stage, q in pool.scheduler.queues().items()}
        now = time.perf_counter()
        waiting = {key: now - since for key, since in self._hungry.items()}  # starved until now
        serving = {name: len(self.serving(name)) for name in self._pools}
        return self._recorder.snapshot(extra_active_s=live, queues=queues, starving=waiting, serving=serving)

    def _expect(self, count: int) -> None:
        for spec in self.graph.stages.values():
            self._pools[spec.model].scheduler.expect(spec.name, count)

    def _admit_chunk(self, run: Run, chunk: list[Any], *, expected: bool) -> None:
        for pos, item in enumerate(chunk):
            if not isinstance(item, Mapping):
                raise FlowDefinitionError(
                    f"input item {run.admitted + pos} is a {type(item).__name__}; items must be mappings of "
                    "field -> value, e.g. {'prompt': x}"
                )
        ids = list(range(self._next_id, self._next_id + len(chunk)))
        costs = self._read_costs(run, chunk)
        batch = Batch.from_samples(ids, chunk)
        self._note_fields(SOURCE, frozenset(batch.keys()))
        ref = self._backend.put(batch)
        self._next_id += len(chunk)
        if not expected:
            self._expect(len(chunk))
        for row, sid in enumerate(ids):
            self._samples[sid] = _SampleState({SOURCE: (ref, row)}, run, costs[row] if costs else 0.0)
        run.admitted += len(chunk)
        for spec in self.graph.consumers(SOURCE):
            if all(i == SOURCE for i in spec.inputs):  # others wait for their upstream stages
                self._pools[spec.model].ready(spec.name, ids, costs)

    def _read_costs(self, run: Run, chunk: list[Any]) -> list[float] | None:
        field = self.config.cost_field
        if field is None:
            return None
        costs = []
        for pos, item in enumerate(chunk):
            value = item.get(field)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                got = "no such field" if field not in item else f"a {type(value).__name__}"
                raise FlowDefinitionError(
                    f"input item {run.admitted + pos}: PipelineConfig.cost_field={field!r} must name a number "
                    f"in every item (a cost estimate), got {got}"
                )
            costs.append(float(value))
        return costs

    # ---- pullers ----
    async def _slot(self, handle: ReplicaHandle) -> None:
        pool, r = self._pools[handle.model], handle.replica_id
        try:
            while True:
                assignment = await pool.next(r)
                self._fed(handle)
                try:
                    if await self._execute(handle, assignment):
                        pool.finish(assignment)
                except ReplicaDiedError as err:
                    self._lost(handle, assignment, err)
                    return
                if not pool.scheduler.in_flight[r]:  # nothing left to run: starved from now on
                    self._hungry[(handle.model, r)] = time.perf_counter()
        except Retired:  # its replica died or was removed while this slot waited
            return
        except Exception as err:
            self._fail(err)
            raise
        finally:
            self._slot_left(handle)

    def _fed(self, handle: ReplicaHandle) -> None:
        since = self._hungry.pop((handle.model, handle.replica_id), None)
        if since is not None:
            self._recorder.starved(handle.model, handle.replica_id, time.perf_counter() - since)

    async def _execute(self, handle: ReplicaHandle, a: Assignment) -> bool:
        """Run shard ``a``; False when it must be sent again (its inputs were lost and computed again)."""
        spec = self.graph.stages[a.stage]
        iteration = self._samples[a.ids[0]].run.index
        call = ShardCall(
            stage=a.stage, method=spec.method, iteration=iteration, ids=a.ids, pieces=self._pieces(a.stage, a.ids)
        )
        scheduler = self._pools[spec.model].scheduler
        # A call's time outside the step tells its overhead only if no other shard of its
        # replica was in flight meanwhile (one queued ahead would be counted as overhead).
        alone = scheduler.in_flight[handle.replica_id] == 1
        start = time.perf_counter()
        try:
            meta, out_ref = await self._call(handle, call)
        except InputLostError as err:
            redone = await self._recompute_lost({sid: self._samples[sid] for sid in a.ids})
            if not redone and self._pieces(a.stage, a.ids) == call.pieces:
                raise  # not lost with a node that is gone (nor computed again by another shard meanwhile)
            self._send_again(handle, a, err)
            return False
        latency = time.perf_counter() - start
        self._check_output(a, handle, meta)
        self._recorder.record(a.stage, handle.replica_id, meta, latency)
        self.timeline.shard(handle.model, handle.replica_id, a.stage, meta.started, meta.step_s, a.ids)
        alone = alone and scheduler.in_flight[handle.replica_id] == 1
        scheduler.measure(a.stage, meta.rows, meta.busy_s, latency - meta.busy_s if alone else None)
        self._complete(a.stage, a.ids, out_ref, handle.node_id)
        return True

    async def _call(self, handle: ReplicaHandle, call: ShardCall) -> tuple[CallMeta, Any]:
        deadline = self.graph.models[handle.model].config.call_timeout_s
        if deadline is None:
            return await self._backend.call(handle, call)
        with anyio.move_on_after(deadline):
            return await self._backend.call(handle, call)
        raise StageError(
            f"no reply within ModelConfig.call_timeout_s={deadline:g}s (the step hangs, or takes longer than that)",
            call.stage,
            handle.replica_id,
            call.ids,
        )

    def _pieces(self, stage: str, ids: list[int], states: Mapping[int, _SampleState] | None = None) -> list[Piece]:
        states = self._samples if states is None else states
        pieces: list[Piece] = []
        for producer in self.graph.inputs_of(stage):
            if self._fields.get(producer) == frozenset():
                continue  # a producer known to add no fields has nothing to gather
            ref, rows = None, []
            for sid in ids:
                r, row = states[sid].loc[producer]
                if r is not ref and rows:
                    pieces.append(Piece(producer=producer, ref=ref, rows=rows))
                    rows = []
                ref = r
                rows.append(row)
            pieces.append(Piece(producer=producer, ref=ref, rows=rows))
        return pieces

    def _check_output(self, a: Assignment, handle: ReplicaHandle, meta: CallMeta) -> None:
        fields = frozenset(meta.fields)
        if meta.rows != len(a.ids):
            raise OutputError(f"returned {meta.rows} rows for {len(a.ids)} samples", a.stage, handle.replica_id, a.ids)
        known = self._fields.get(a.stage)
        if known is not None and known != fields:
            raise OutputError(
                f"returned fields {sorted(fields)}, but its earlier shards returned {sorted(known)}; "
                "every shard of a stage must add the same fields",
                a.stage,
                handle.replica_id,
                a.ids,
            )
        self._note_fields(a.stage, fields)

    def _note_fields(self, producer: str, fields: frozenset[str]) -> None:
        known = self._fields.get(producer)
        if known is not None:
            if producer == SOURCE and known != fields:
                raise FlowDefinitionError(
                    f"input items have fields {sorted(fields)}, earlier items had {sorted(known)}"
                )
            return
        self._fields[producer] = fields
        for other in self.graph.cohabitants(producer):
            clash = sorted(fields & self._fields.get(other, frozenset()))
            if clash:
                names = ["the flow input" if p == SOURCE else f"stage {p!r}" for p in (other, producer)]
                raise FlowDefinitionError(
                    f"field(s) {clash} are written by both {names[0]} and {names[1]}, and a later stage or "
                    "the flow's output sees both; a field must have one writer — rename one of them"
                )
        if producer == SOURCE:
            self.graph.validate(fields)

    def _complete(self, stage: str, ids: list[int], out_ref: Any, node: str) -> None:
        consumers = self.graph.consumers(stage)
        ready: dict[str, list[int]] = {spec.name: [] for spec in consumers}
        finished: list[int] = []
        for row, sid in enumerate(ids):
            state = self._samples[sid]
            if stage in state.done:
                raise FlowError(f"internal: stage {stage!r} processed sample {sid} twice")
            state.done.add(stage)
            state.loc[stage] = (out_ref, row)
            state.node[stage] = node
            for spec in consumers:
                if all(i == SOURCE or i in state.done for i in spec.inputs):
                    ready[spec.name].append(sid)
            if len(state.done) == len(self.graph.stages):
                finished.append(sid)
        for spec in consumers:
            ids_ready = ready[spec.name]
            if ids_ready:
                costs = [self._samples[sid].cost for sid in ids_ready] if self.config.cost_field else None
                self._pools[spec.model].ready(spec.name, ids_ready, costs)
        self._finish(finished)

    def _finish(self, ids: list[int]) -> None:
        producers: dict[Run, tuple[str, ...]] = {}  # per run: the producers it returns fields of
        for sid in ids:
            state = self._samples.pop(sid)
            if self._retries:  # its retry counts: ids are reused after a resume
                for stage in self.graph.stages:
                    self._retries.pop((stage, sid), None)
            run = state.run
            run.finished += 1
            if run not in producers:
                producers[run] = self._output_producers(run.fields)
            if run.abandoned:
                self._window.release(1)
            else:
                run.states[sid] = state  # until delivered: an output lost meanwhile is computed again
                run.send.send_nowait((sid, {p: state.loc[p] for p in producers[run]}))
        for run in producers:
            run.maybe_close()

    def _output_producers(self, fields: frozenset[str] | None) -> tuple[str, ...]:
        producers = self.graph.output_producers
        if fields is None:
            return producers
        return tuple(p for p in producers if self._fields.get(p, frozenset()) & fields)

    def _output_fields(self) -> list[str]:
        return sorted(f for p in self.graph.output_producers for f in self._fields.get(p, ()))
