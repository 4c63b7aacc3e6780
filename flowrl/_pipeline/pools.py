"""Async wrappers of the sans-IO scheduler: waiting slots and the in-flight window."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._core.scheduling.scheduler import Assignment, PoolScheduler

    Places = Callable[[str, list[int]], "list[tuple[int, int]] | None"]


class _Waiter:
    # A bare asyncio future: an anyio.Event per shard costs its creator a lookup of the
    # running async library, a noticeable share of the driver's time per small shard.
    __slots__ = ("future",)

    def __init__(self) -> None:
        self.future: asyncio.Future[Assignment] = asyncio.get_running_loop().create_future()


class Retired(Exception):
    """Raised in a slot whose replica was retired while the slot waited for a shard."""


class AsyncPool:
    """A pool's slots wait here for the scheduler to hand them a shard."""

    def __init__(self, scheduler: PoolScheduler) -> None:
        self.scheduler = scheduler
        self.replacing = 0  # replicas starting in place of stopped ones (``Resizer.replace``)
        # deterministic mode: each sample's (run, position in it) on a stage (``blocks.Places``)
        self.places: Places | None = None
        self._waiters: dict[int, deque[_Waiter]] = {r: deque() for r in range(scheduler.replicas)}

    async def next(self, replica: int) -> Assignment:
        """Ask for a shard for one idle slot of ``replica`` and wait until one is cut."""
        if replica in self.scheduler.retired:  # removed while its shard ran
            raise Retired()
        waiter = _Waiter()
        self._waiters[replica].append(waiter)
        self.scheduler.request(replica)
        self.pump()
        return await waiter.future

    def ready(self, stage: str, ids: list[int], costs: list[float] | None = None) -> None:
        places = None if self.places is None else self.places(stage, ids)
        self.scheduler.ready(stage, ids, costs, places)
        self.pump()

    def seal(self, run: int, count: int) -> None:
        """Run ``run``'s admission is done with ``count`` samples (deterministic mode: its last
        block may be cut now)."""
        if self.scheduler.deterministic:
            self.scheduler.seal(run, count)
            self.pump()

    def finish(self, assignment: Assignment) -> None:
        self.scheduler.finish(assignment)
        self.pump()  # a slot of that replica may wait for it to finish (see ``queue_ahead``)

    def add_replica(self, joining: bool = False) -> int:
        replica = self.scheduler.add_replica(joining)
        self._waiters[replica] = deque()
        return replica

    def retire(self, replica: int) -> None:
        """``replica`` died or is removed: its waiting slots stop, and it gets no more shards."""
        self.scheduler.retire(replica)
        waiters, self._waiters[replica] = self._waiters[replica], deque()
        for waiter in waiters:
            if not waiter.future.done():
                waiter.future.set_exception(Retired())
        self.pump()  # the shards it would have taken are now cut for the others

    def give_back(self, assignment: Assignment, costs: list[float] | None, dropped: list[int] | None = None) -> None:
        self.scheduler.give_back(assignment, costs, dropped or ())
        self.pump()

    def pump(self) -> None:
        for assignment in self.scheduler.poll():
            waiter = self._waiters[assignment.replica].popleft()
            if not waiter.future.done():  # else its slot was cancelled: the run is ending
                waiter.future.set_result(assignment)


class Window:
    """At most ``limit`` samples admitted and not yet handed back: the bound of every queue."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._changed: anyio.Event | None = None  # only while someone waits for room

    @property
    def free(self) -> int:
        return self.limit - self.used

    async def acquire(self, up_to: int) -> int:
        """Wait for room, then take as much as is free, at most ``up_to``."""
        while self.used >= self.limit:
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()
        n = min(up_to, self.limit - self.used)
        self.used += n
        return n

    def release(self, n: int) -> None:
        if n:
            self.used -= n
            if self._changed is not None:  # wake every waiter; each checks for room again
                self._changed.set()
                self._changed = None
