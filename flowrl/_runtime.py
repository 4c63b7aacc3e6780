"""The stage runtime (layer 5): pullers per replica slot, the join by sample id, streaming runs.

The driver keeps, per sample, where each producer's fields live (object reference, row) and
which stages are done. A stage is offered a sample when all its inputs are done for it; its
pool's slots pull shards cut on demand. Payloads never pass through here, only references.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ._backend import Backend, ReplicaHandle
from ._batch import Batch, Sample
from ._config import CallMeta, Piece, PipelineConfig, ShardCall
from ._errors import FlowDefinitionError, FlowError, OutputError, PipelineClosedError
from ._graph import SOURCE, FlowGraph
from ._pool import AsyncPool, Window
from ._scheduler import Assignment, PoolScheduler
from ._stats import PipelineStats, StatsRecorder

Loc = tuple[Any, int]  # (object reference, row)
Items = Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]]


class _SampleState:
    __slots__ = ("loc", "done")

    def __init__(self, loc: dict[str, Loc]) -> None:
        self.loc = loc
        self.done: set[str] = set()


class _Run:
    def __init__(self, index: int, first_id: int, ordered: bool, limit: int) -> None:
        self.index = index
        self.first_id = first_id
        self.ordered = ordered
        self.admitted = 0
        self.finished = 0
        self.admission_done = False
        self.abandoned = False
        self.send, self.recv = anyio.create_memory_object_stream[tuple[int, dict[str, Loc]]](limit)
        self.drained = anyio.Event()
        self.held: dict[int, dict[str, Loc]] = {}
        self.fields: frozenset[str] | None = None  # None: every field of the flow's output

    def maybe_close(self) -> None:
        if self.admission_done and self.finished == self.admitted:
            self.send.close()
            self.drained.set()


class AsyncPipeline:
    """A running flow. Use it inside ``async with flowrl.open_pipeline(...)``."""

    def __init__(self, graph: FlowGraph, backend: Backend, config: PipelineConfig, handles: list[ReplicaHandle]) -> None:
        self.graph = graph
        self.config = config
        self._backend = backend
        self._handles = handles
        self._pools: dict[str, AsyncPool] = {}
        for name, model in graph.models.items():
            sched = PoolScheduler(replicas=model.config.replicas, policy=model.config.splitter, prefetch=model.config.prefetch)
            for stage in graph.stages_of(name):
                sched.add_stage(stage, model.config.batch_size)
            self._pools[name] = AsyncPool(sched)
        self._recorder = StatsRecorder(
            {s.name: s.model for s in graph.stages.values()}, {n: m.config.replicas for n, m in graph.models.items()}
        )
        self._window = Window(config.max_inflight)
        self._samples: dict[int, _SampleState] = {}
        self._fields: dict[str, frozenset[str]] = {}
        self._next_id = 0
        self._runs = 0
        self._run: _Run | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._run_started: float | None = None
        self._tg: TaskGroup | None = None

    # ---- lifecycle ----
    def start(self, tg: TaskGroup) -> None:
        self._tg = tg
        for handle in self._handles:
            model = self.graph.models[handle.model]
            for _ in range(model.config.prefetch):
                tg.start_soon(self._slot, handle)

    def fail(self, err: BaseException) -> None:
        """Wake a consumer that waits outside the task group (the sync wrapper's calls)."""
        if self._error is None:
            self._error = err
        if self._run is not None:
            self._run.send.close()

    @property
    def placement(self) -> dict[str, list[str]]:
        """Node id of each replica, per model."""
        out: dict[str, list[str]] = {m: [""] * c.config.replicas for m, c in self.graph.models.items()}
        for h in self._handles:
            out[h.model][h.replica_id] = h.node_id
        return out

    def stats(self) -> PipelineStats:
        """Counters so far; a stream in progress counts its time up to now."""
        live = 0.0 if self._run_started is None else time.perf_counter() - self._run_started
        return self._recorder.snapshot(extra_active_s=live)

    # ---- public runs ----
    async def run(
        self, items: Items, *, ordered: bool | None = None, fields: Iterable[str] | None = None
    ) -> list[Sample]:
        """Run every item through the flow; the finished samples, in input order by default."""
        stream = self.stream(items, ordered=ordered, fields=fields)
        try:
            return [s async for s in stream]
        finally:
            await stream.aclose()

    async def stream(
        self, items: Items, *, ordered: bool | None = None, fields: Iterable[str] | None = None
    ) -> AsyncIterator[Sample]:
        """Yield finished samples as the flow produces them (input order unless ``ordered=False``).

        ``fields`` limits what comes back to the driver: only the objects holding those fields
        are fetched; everything else stays in the object store.
        """
        run = await self._begin(ordered)
        run.fields = None if fields is None else frozenset([fields] if isinstance(fields, str) else fields)
        started = self._run_started = time.perf_counter()
        assert self._tg is not None
        self._tg.start_soon(self._admit, run, items)
        try:
            async for sample in self._deliver(run):
                yield sample
        finally:
            self._abandon(run)
            self._run_started = None
            self._recorder.add_active(time.perf_counter() - started)

    def _abandon(self, run: _Run) -> None:
        """The consumer stopped: finished samples it never took give their room back."""
        run.abandoned = True
        dropped = len(run.held)
        run.held.clear()
        while True:
            try:
                run.recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            dropped += 1
        run.recv.close()
        self._window.release(dropped)

    async def _begin(self, ordered: bool | None) -> _Run:
        self._raise_if_failed()
        previous = self._run
        if previous is not None and not previous.drained.is_set():
            # One stream at a time: a new one supersedes a stream left unfinished (e.g. by
            # `break`); its samples already admitted finish and are counted, then dropped.
            if not previous.abandoned:
                self._abandon(previous)
            await previous.drained.wait()
        run = _Run(self._runs, self._next_id, self.config.ordered if ordered is None else ordered, self.config.max_inflight)
        self._runs += 1
        self._run = run
        return run

    def close(self) -> None:
        self._closed = True

    def _raise_if_failed(self) -> None:
        if self._closed:
            raise PipelineClosedError("the pipeline is closed; open a new one")
        if self._error is not None:
            raise PipelineClosedError(f"the pipeline failed earlier: {self._error}") from self._error

    # ---- admission: items -> input objects -> ready queues ----
    async def _admit(self, run: _Run, items: Any) -> None:
        try:
            await self._admit_all(run, items)
        except Exception as err:
            self.fail(err)
            raise

    async def _admit_all(self, run: _Run, items: Any) -> None:
        total = len(items) if hasattr(items, "__len__") else None
        if total:
            self._expect(total)
        source = _aiter(items)
        exhausted = False
        while not exhausted and not run.abandoned:
            room = await self._window.acquire(self.config.input_chunk)
            chunk: list[Any] = []
            while len(chunk) < room:
                try:
                    chunk.append(await anext(source))
                except StopAsyncIteration:
                    exhausted = True
                    break
            self._window.release(room - len(chunk))
            if chunk:
                self._admit_chunk(run, chunk, expected=total is not None and run.admitted + len(chunk) <= total)
        if total is not None and run.admitted < total:
            self._expect(run.admitted - total)  # the input was shorter than its len()
        run.admission_done = True
        run.maybe_close()

    def _expect(self, count: int) -> None:
        for spec in self.graph.stages.values():
            self._pools[spec.model].scheduler.expect(spec.name, count)

    def _admit_chunk(self, run: _Run, chunk: list[Any], *, expected: bool) -> None:
        first = self._next_id
        for pos, item in enumerate(chunk):
            if not isinstance(item, Mapping):
                raise FlowDefinitionError(
                    f"input item {run.admitted + pos} is a {type(item).__name__}; items must be mappings of "
                    "field -> value, e.g. {'prompt': x}"
                )
        ids = list(range(first, first + len(chunk)))
        batch = Batch.from_samples(ids, chunk)
        self._note_fields(SOURCE, frozenset(batch.keys()))
        ref = self._backend.put(batch)
        self._next_id += len(chunk)
        if not expected:
            self._expect(len(chunk))
        for row, sid in enumerate(ids):
            self._samples[sid] = _SampleState({SOURCE: (ref, row)})
        run.admitted += len(chunk)
        for stage in self.graph.consumers(SOURCE):
            self._pools[self.graph.stages[stage].model].ready(stage, ids)

    # ---- pullers ----
    async def _slot(self, handle: ReplicaHandle) -> None:
        pool = self._pools[handle.model]
        try:
            while True:
                assignment = await pool.next(handle.replica_id)
                await self._execute(handle, assignment)
                pool.finish(assignment)
        except Exception as err:
            self.fail(err)
            raise

    async def _execute(self, handle: ReplicaHandle, a: Assignment) -> None:
        spec = self.graph.stages[a.stage]
        assert self._run is not None
        call = ShardCall(stage=a.stage, method=spec.method, iteration=self._run.index, ids=a.ids, pieces=self._pieces(a.stage, a.ids))
        meta, out_ref = await self._backend.call(handle, call)
        self._check_output(a, handle, meta)
        self._recorder.record(a.stage, handle.replica_id, meta.rows, meta.busy_s)
        self._complete(a.stage, a.ids, out_ref)

    def _pieces(self, stage: str, ids: list[int]) -> list[Piece]:
        pieces: list[Piece] = []
        for producer in self.graph.inputs_of(stage):
            if self._fields.get(producer) == frozenset():
                continue  # a producer known to add no fields has nothing to gather
            ref, rows = None, []
            for sid in ids:
                r, row = self._samples[sid].loc[producer]
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
                raise FlowDefinitionError(f"input items have fields {sorted(fields)}, earlier items had {sorted(known)}")
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

    def _complete(self, stage: str, ids: list[int], out_ref: Any) -> None:
        consumers = [(c, self.graph.stages[c]) for c in self.graph.consumers(stage)]
        ready: dict[str, list[int]] = {c: [] for c, _ in consumers}
        finished: list[int] = []
        for row, sid in enumerate(ids):
            state = self._samples[sid]
            if stage in state.done:
                raise FlowError(f"internal: stage {stage!r} processed sample {sid} twice")
            state.done.add(stage)
            state.loc[stage] = (out_ref, row)
            for c, spec in consumers:
                if all(i == SOURCE or i in state.done for i in spec.inputs):
                    ready[c].append(sid)
            if len(state.done) == len(self.graph.stages):
                finished.append(sid)
        for c, spec in consumers:
            if ready[c]:
                self._pools[spec.model].ready(c, ready[c])
        self._finish(finished)

    def _finish(self, ids: list[int]) -> None:
        run = self._run
        assert run is not None
        producers = self._output_producers(run.fields)
        for sid in ids:
            state = self._samples.pop(sid)
            run.finished += 1
            if run.abandoned:
                self._window.release(1)
            else:
                run.send.send_nowait((sid, {p: state.loc[p] for p in producers}))
        run.maybe_close()

    def _output_producers(self, fields: frozenset[str] | None) -> tuple[str, ...]:
        producers = self.graph.output_producers
        if fields is None:
            return producers
        return tuple(p for p in producers if self._fields.get(p, frozenset()) & fields)

    # ---- delivery: finished samples -> Sample objects, in order ----
    async def _deliver(self, run: _Run) -> AsyncIterator[Sample]:
        cache: dict[Any, list[Any]] = {}  # ref -> [Batch | None, uses left]
        held = run.held
        next_id = run.first_id
        async for sid, loc in _superseded_check(run.recv):
            for ref, _ in loc.values():
                cache.setdefault(ref, [None, 0])[1] += 1
            held[sid] = loc
            while held:
                sid = next_id if run.ordered else next(iter(held))
                if sid not in held:
                    break
                sample = await self._materialize(sid, held[sid], cache, run.fields)
                del held[sid]
                self._window.release(1)
                next_id += 1
                yield sample
        if isinstance(self._error, FlowError):
            raise self._error  # the failure that stopped the run, as the task group reports it
        self._raise_if_failed()

    async def _materialize(
        self, sid: int, loc: dict[str, Loc], cache: dict[Any, list[Any]], wanted: frozenset[str] | None
    ) -> Sample:
        missing = list(dict.fromkeys(ref for ref, _ in loc.values() if cache[ref][0] is None))
        if missing:
            for ref, obj in zip(missing, await self._backend.fetch(missing)):
                cache[ref][0] = obj
        fields: dict[str, Any] = {}
        for ref, row in loc.values():
            entry = cache[ref]
            fields.update(entry[0].row(row))
            entry[1] -= 1
            if entry[1] == 0:
                del cache[ref]
        if wanted is not None:
            if not wanted <= fields.keys():
                produced = sorted(f for p in self.graph.output_producers for f in self._fields.get(p, ()))
                raise FlowDefinitionError(
                    f"requested output field(s) {sorted(wanted - fields.keys())} are not in the flow's output; "
                    f"it has {produced}"
                )
            fields = {k: v for k, v in fields.items() if k in wanted}
        return Sample(sid, fields)


async def _superseded_check(recv: Any) -> AsyncIterator[Any]:
    try:
        async for item in recv:
            yield item
    except anyio.ClosedResourceError:
        raise PipelineClosedError("this stream was superseded: a newer stream started on the pipeline") from None


async def _aiter(items: Any) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
