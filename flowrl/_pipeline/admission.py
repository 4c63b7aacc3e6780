"""Admission: input items into the in-flight window, chunk by chunk.

Items are read only while the window has room (``PipelineConfig.max_inflight``), so every
queue downstream stays bounded. Each chunk becomes one input object in the store and one
block of sample ids in the ledger; the stages that read only the flow's input are offered it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping, Sized
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import numpy as np

from .._core.errors import FlowDefinitionError
from .._core.flow.batch import Batch
from .._core.flow.columns import FieldTypes
from .._core.flow.graph import SOURCE
from .blocks import seal

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectSendStream

    from .._backends.abc import ObjectStore
    from .inflight import Run
    from .parts import Parts

Take = Callable[[int], Awaitable[tuple[list[Any], bool]]]


class Admission:
    def __init__(self, parts: Parts) -> None:
        self._graph = parts.graph
        self._config = parts.config
        self._store: ObjectStore = parts.backend
        self._ledger = parts.ledger
        self._pools = parts.pools
        self._window = parts.window
        self._recorder = parts.recorder
        self._supervisor = parts.supervisor
        # Kept for the pipeline's life, not per run: an engine's episodes are runs of one
        # pipeline, and a field that is int64 in episode 1 must not turn float64 in episode 3.
        self._types = FieldTypes.inputs()

    def expect(self, count: int) -> None:
        """Tell every stage that ``count`` more samples will come (negative: fewer)."""
        for spec in self._graph.stages.values():
            self._pools[spec.model].scheduler.expect(spec.name, count)

    async def admit(self, run: Run, items: Any) -> None:
        """Admit ``items`` into ``run`` until they end or the run is abandoned."""
        with anyio.CancelScope() as scope:
            run.stop_admission = scope.cancel  # an abandoned run stops reading its input
            try:
                await self._admit_all(run, items)
            except Exception as err:
                self._supervisor.fail(err)
                raise

    async def _admit_all(self, run: Run, items: Any) -> None:
        total = len(items) if isinstance(items, Sized) else None
        announced = 0
        if total:
            self.expect(total)
            # What the window holds now is admitted without waiting for any sample to finish:
            # the ``cost`` splitter may wait for it as for samples upstream, instead of cutting
            # the first chunk alone (1,024 prompts cut 64 + 960 paid a call's fixed cost twice)
            announced = min(total, self._window.free)
            self._announce(announced)
        take, close = self._taker(items)
        exhausted = False
        # With estimates (a list in memory), admit as much as the window holds at once: the
        # stages can only start the costliest first among the samples admitted so far.
        chunk_size = self._config.input_chunk if run.costs is None else self._window.limit
        try:
            while not exhausted and not run.abandoned:
                waiting = time.perf_counter()
                room = await self._window.acquire(chunk_size)
                self._recorder.blocked_s += time.perf_counter() - waiting
                chunk: list[Any] = []
                try:
                    if not run.abandoned:
                        chunk, exhausted = await take(room)
                finally:
                    self._window.release(room - len(chunk))
                if chunk:
                    expected = total is not None and run.admitted + len(chunk) <= total
                    if run.admitted + len(chunk) > announced:  # before the stages see them
                        self._announce(run.admitted + len(chunk) - announced)
                        announced = run.admitted + len(chunk)
                    self._admit_chunk(run, chunk, expected=expected)
                    # let the dispatcher send the first shards now: admitting 400 items
                    # before any was sent started a run's first calls 4 ms late (2 cores)
                    await anyio.lowlevel.checkpoint()
        finally:
            close()  # stops an async source's pump
            if total is not None and run.admitted < total:
                self.expect(run.admitted - total)  # fewer than len() said
            if announced > run.admitted:  # abandoned, or fewer than len() said
                self._announce(run.admitted - announced)
            run.admission_done = True
            seal(self._pools, run)  # deterministic mode: the run's last block may be cut now
            run.maybe_close()

    def _admit_chunk(self, run: Run, chunk: list[Any], *, expected: bool) -> None:
        for pos, item in enumerate(chunk):
            if not isinstance(item, Mapping):
                raise FlowDefinitionError(
                    f"input item {run.admitted + pos} is a {type(item).__name__}; items must be mappings of "
                    "field -> value, e.g. {'prompt': x}"
                )
        costs = self._read_costs(run, chunk)
        first = self._ledger.next_id
        if run.ids is None:
            ids = list(range(first, first + len(chunk)))
        else:
            ids = run.ids[run.admitted : run.admitted + len(chunk)]
        batch = Batch.from_items(ids, chunk, first_item=run.admitted)
        self._types.check(batch)
        self._ledger.note_fields(SOURCE, frozenset(batch.keys()))
        self._ledger.admit(run, ids, self._store.put(batch), costs)
        if not expected:
            self.expect(len(chunk))
        run.admitted += len(chunk)
        for spec in self._graph.consumers(SOURCE):
            if all(i == SOURCE for i in spec.inputs):  # others wait for their upstream stages
                self._pools[spec.model].ready(spec.name, ids, costs)

    def _announce(self, count: int) -> None:
        """``count`` samples enter (negative: will not enter) the pipeline: every stage's
        ``cost`` splitter may wait for them. Fewer: a stage that waited is asked again."""
        for spec in self._graph.stages.values():
            self._pools[spec.model].scheduler.admit(spec.name, count)
        if count < 0:
            for model in {spec.model for spec in self._graph.stages.values()}:
                self._pools[model].pump()

    def _read_costs(self, run: Run, chunk: list[Any]) -> list[float] | None:
        if run.costs is not None:
            return run.costs[run.admitted : run.admitted + len(chunk)]
        field = self._config.cost_field
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
        self._supervisor.start_soon(self._pump_source, items, send)

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

    async def _pump_source(self, items: AsyncIterable[Any], send: MemoryObjectSendStream[Any]) -> None:
        try:
            async with send:
                async for item in items:
                    await send.send(item)
        except anyio.BrokenResourceError:
            pass  # the run was abandoned
        except Exception as err:
            self._supervisor.fail(err)
            raise
