"""Streaming runs (layer 5): admission of input items, ordered delivery, early exit.

A run admits items into the in-flight window, chunk by chunk, and delivers finished
samples in input order (or as completed). One run is active at a time; a new one
supersedes a run whose consumer left early. Mixed into ``AsyncPipeline``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sized
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from .._core.batch import Sample
from .._core.errors import FlowDefinitionError, InputLostError, PipelineClosedError

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from .pools import Window

Loc = tuple[Any, int]  # (object reference, row)
Items = Iterable[Mapping[str, Any]] | AsyncIterable[Mapping[str, Any]]
Take = Callable[[int], Awaitable[tuple[list[Any], bool]]]


class Run:
    def __init__(self, index: int, first_id: int, ordered: bool, limit: int, fields: frozenset[str] | None) -> None:
        self.index = index
        self.first_id = first_id
        self.ordered = ordered
        self.fields = fields  # None: every field of the flow's output
        self.admitted = 0
        self.finished = 0
        self.admission_done = False
        self.abandoned = False
        self.send, self.recv = anyio.create_memory_object_stream[tuple[int, dict[str, Loc]]](limit)
        self.drained = anyio.Event()
        self.held: dict[int, dict[str, Loc]] = {}
        self.states: dict[int, Any] = {}  # finished samples not yet delivered: their whole state
        self.started = time.perf_counter()
        self.active_closed = False
        self.stop_admission: Any = lambda: None

    def maybe_close(self) -> None:
        if self.admission_done and self.finished == self.admitted:
            self.send.close()
            self.drained.set()


def _relocate(run: Run, cache: dict[Any, list[Any]]) -> int:
    """Point the held samples at their current outputs (some were computed again); returns
    how many changed."""
    changed = 0
    for sid, old in run.held.items():
        new = {p: run.states[sid].loc[p] for p in old}
        if new == old:
            continue
        changed += 1
        for ref, _ in old.values():
            entry = cache[ref]
            entry[1] -= 1
            if entry[1] == 0:
                del cache[ref]
        for ref, _ in new.values():
            cache.setdefault(ref, [None, 0])[1] += 1
        run.held[sid] = new
    return changed


async def _next_finished(run: Run) -> tuple[int, dict[str, Loc]] | None:
    """The next finished sample of ``run`` (None at its end). One already queued is taken at
    once: anyio's ``receive`` would first pass through the event loop, for every sample."""
    try:
        return run.recv.receive_nowait()
    except anyio.WouldBlock:
        pass
    except anyio.EndOfStream:
        return None
    try:
        return await run.recv.receive()
    except anyio.EndOfStream:
        return None


class StreamingMixin:
    """``run`` / ``stream`` for ``AsyncPipeline`` (which provides the hooks used here)."""

    _window: Window
    _run: Run | None
    _runs: int
    _next_id: int
    _error: BaseException | None
    _closed: bool
    _tg: TaskGroup | None
    _begin_lock: anyio.Lock

    async def run(
        self, items: Items, *, ordered: bool | None = None, fields: Iterable[str] | None = None
    ) -> list[Sample]:
        """Run every item through the flow; the finished samples, in input order by default."""
        stream = self.stream(items, ordered=ordered, fields=fields)
        try:
            return [s async for s in stream]
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def stream(
        self, items: Items, *, ordered: bool | None = None, fields: Iterable[str] | None = None
    ) -> AsyncIterator[Sample]:
        """Yield finished samples as the flow produces them (input order unless ``ordered=False``).

        ``fields`` limits what comes back to the driver: only the objects holding those fields
        are fetched; everything else stays in the object store.
        """
        wanted = None if fields is None else frozenset([fields] if isinstance(fields, str) else fields)
        run = await self._begin(ordered, wanted)
        assert self._tg is not None
        self._tg.start_soon(self._admit, run, items)
        view = self._show(run)
        try:
            async for sample in self._deliver(run):
                yield sample
        finally:
            self._abandon(run)
            self._shown(run, view)

    def _show(self, run: Run) -> tuple[str, dict[str, int], anyio.CancelScope | None] | None:
        """Start the run's progress view (``PipelineConfig.progress``)."""
        from .progress import mode, watch_run

        shown = mode(self.config.progress)  # type: ignore[attr-defined]
        if shown == "off":
            return None
        base = {name: s.samples for name, s in self.stats().stages.items()}  # type: ignore[attr-defined]
        scope = anyio.CancelScope() if shown == "live" else None
        if scope is not None and self._tg is not None:
            self._tg.start_soon(watch_run, self, run, base, scope)
        return shown, base, scope

    def _shown(self, run: Run, view: tuple[str, dict[str, int], anyio.CancelScope | None] | None) -> None:
        if view is None:
            return
        from .progress import log, run_line

        shown, base, scope = view
        if scope is not None:
            scope.cancel()
        if shown == "log" and run.admission_done and run.finished == run.admitted:
            log.info(run_line(self, run, base))  # type: ignore[arg-type]

    async def _begin(self, ordered: bool | None, fields: frozenset[str] | None) -> Run:
        async with self._begin_lock:
            self._raise_if_failed()
            previous = self._run
            if previous is not None and not previous.drained.is_set():
                # One stream at a time: a new one supersedes a stream left unfinished (e.g. by
                # `break`); its samples already admitted finish and are counted, then dropped.
                self._abandon(previous)
                await previous.drained.wait()  # a failure sets it too
                self._raise_if_failed()
            ordered = self.config.ordered if ordered is None else ordered  # type: ignore[attr-defined]
            run = Run(self._runs, self._next_id, ordered, self._window.limit, fields)
            self._runs += 1
            self._run = run
            return run

    async def settle(self) -> None:
        """Stop the current run's admission and wait until what it admitted has finished (its
        samples are dropped): then the pipeline can be renumbered (``resume_at``)."""
        run = self._run
        if run is not None and not run.drained.is_set():
            self._abandon(run)
            await run.drained.wait()  # a failure sets it too
        self._raise_if_failed()

    def _abandon(self, run: Run) -> None:
        """The consumer stopped: finished samples it never took give their room back."""
        if not run.active_closed:
            run.active_closed = True
            self._recorder.add_active(time.perf_counter() - run.started)  # type: ignore[attr-defined]
        if run.abandoned:
            return
        run.abandoned = True
        run.stop_admission()
        dropped = len(run.held)
        run.held.clear()
        run.states.clear()
        while True:
            try:
                run.recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            dropped += 1
        run.recv.close()
        self._window.release(dropped)

    def _raise_if_failed(self) -> None:
        if self._closed:
            raise PipelineClosedError("the pipeline is closed; open a new one")
        if self._error is not None:
            raise PipelineClosedError(f"the pipeline failed earlier: {self._error!r}") from self._error

    # ---- admission: items -> input objects -> ready queues ----
    async def _admit(self, run: Run, items: Any) -> None:
        with anyio.CancelScope() as scope:
            run.stop_admission = scope.cancel  # an abandoned run stops reading its input
            try:
                await self._admit_all(run, items)
            except Exception as err:
                self._fail(err)  # type: ignore[attr-defined]
                raise

    async def _admit_all(self, run: Run, items: Any) -> None:
        total = len(items) if isinstance(items, Sized) else None
        if total:
            self._expect(total)  # type: ignore[attr-defined]
        take, close = self._taker(items)
        exhausted = False
        try:
            while not exhausted and not run.abandoned:
                waiting = time.perf_counter()
                room = await self._window.acquire(self.config.input_chunk)  # type: ignore[attr-defined]
                self._recorder.blocked_s += time.perf_counter() - waiting  # type: ignore[attr-defined]
                chunk: list[Any] = []
                try:
                    if not run.abandoned:
                        chunk, exhausted = await take(room)
                finally:
                    self._window.release(room - len(chunk))
                if chunk:
                    expected = total is not None and run.admitted + len(chunk) <= total
                    self._admit_chunk(run, chunk, expected=expected)  # type: ignore[attr-defined]
        finally:
            close()  # stops an async source's pump
            if total is not None and run.admitted < total:
                self._expect(run.admitted - total)  # type: ignore[attr-defined]  # fewer than len() said
            run.admission_done = True
            run.maybe_close()

    def _taker(self, items: Any) -> tuple[Take, Callable[[], None]]:
        """``take(room) -> (items, exhausted)``, which never waits for a full chunk, and its closer."""
        if not isinstance(items, AsyncIterable):
            iterator = iter(items)

            async def take_sync(room: int) -> tuple[list[Any], bool]:
                chunk = []
                for item in iterator:
                    chunk.append(item)
                    if len(chunk) == room:
                        return chunk, False
                return chunk, True

            return take_sync, lambda: None
        # An async source may wait for results before it yields more (a feedback loop):
        # admit what is ready now rather than wait for a full chunk. Unbuffered: at most one
        # item is drawn ahead of the window.
        send, recv = anyio.create_memory_object_stream[Any](0)
        assert self._tg is not None
        self._tg.start_soon(self._pump_source, items, send)

        async def take_async(room: int) -> tuple[list[Any], bool]:
            try:
                chunk = [await recv.receive()]
            except anyio.EndOfStream:
                return [], True
            while len(chunk) < room:
                try:
                    chunk.append(recv.receive_nowait())
                except anyio.WouldBlock:
                    break
                except anyio.EndOfStream:
                    return chunk, True
            return chunk, False

        return take_async, recv.close

    async def _pump_source(self, items: AsyncIterable[Any], send: Any) -> None:
        try:
            async with send:
                async for item in items:
                    await send.send(item)
        except anyio.BrokenResourceError:
            pass  # the run was abandoned
        except Exception as err:
            self._fail(err)  # type: ignore[attr-defined]
            raise

    # ---- delivery: finished samples -> Sample objects, in order ----
    async def _deliver(self, run: Run) -> AsyncIterator[Sample]:
        cache: dict[Any, list[Any]] = {}  # ref -> [Batch | None, uses left]
        held = run.held
        next_id = run.first_id
        try:
            while (item := await _next_finished(run)) is not None:
                sid, loc = item
                for ref, _ in loc.values():
                    cache.setdefault(ref, [None, 0])[1] += 1
                held[sid] = loc
                while held:
                    sid = next_id if run.ordered else next(iter(held))
                    if sid not in held:
                        break
                    # Each sample handed out is a cancellation point, also when its data is
                    # already in the driver and nothing below would wait.
                    await anyio.lowlevel.checkpoint_if_cancelled()
                    try:
                        sample = await self._materialize(sid, held[sid], cache, run.fields)
                    except InputLostError:
                        redone = await self._recompute_lost(run.states)  # type: ignore[attr-defined]
                        if not _relocate(run, cache) and not redone:
                            raise
                        continue  # the same sample, from the outputs computed again
                    del held[sid]
                    run.states.pop(sid, None)
                    self._window.release(1)
                    next_id += 1
                    yield sample
        except anyio.ClosedResourceError:
            raise PipelineClosedError("this stream was superseded: a newer stream started on the pipeline") from None
        if self._error is not None:
            raise self._error  # the failure that stopped the run, as it was raised
        self._raise_if_failed()

    async def _materialize(
        self, sid: int, loc: dict[str, Loc], cache: dict[Any, list[Any]], wanted: frozenset[str] | None
    ) -> Sample:
        missing = list(dict.fromkeys(ref for ref, _ in loc.values() if cache[ref][0] is None))
        if missing:
            for ref, obj in zip(missing, await self._backend.fetch(missing)):  # type: ignore[attr-defined]
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
                raise FlowDefinitionError(
                    f"requested output field(s) {sorted(wanted - fields.keys())} are not in the flow's output; "
                    f"it has {self._output_fields()}"  # type: ignore[attr-defined]
                )
            fields = {k: v for k, v in fields.items() if k in wanted}
        return Sample(sid, fields)
