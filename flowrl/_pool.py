"""Async wrappers of the sans-IO scheduler (layer 5): waiting slots and the in-flight window."""

from __future__ import annotations

from collections import deque

import anyio

from ._scheduler import Assignment, PoolScheduler


class _Waiter:
    __slots__ = ("event", "assignment")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.assignment: Assignment | None = None


class AsyncPool:
    """A pool's slots wait here for the scheduler to hand them a shard."""

    def __init__(self, scheduler: PoolScheduler) -> None:
        self.scheduler = scheduler
        self._waiters: dict[int, deque[_Waiter]] = {r: deque() for r in range(scheduler.replicas)}

    async def next(self, replica: int) -> Assignment:
        """Ask for a shard for one idle slot of ``replica`` and wait until one is cut."""
        waiter = _Waiter()
        self._waiters[replica].append(waiter)
        self.scheduler.request(replica)
        self.pump()
        await waiter.event.wait()
        assert waiter.assignment is not None
        return waiter.assignment

    def ready(self, stage: str, ids: list[int], costs: list[float] | None = None) -> None:
        self.scheduler.ready(stage, ids, costs)
        self.pump()

    def finish(self, assignment: Assignment) -> None:
        self.scheduler.finish(assignment)
        self.pump()  # a slot of that replica may wait for it to finish (see ``queue_ahead``)

    def pump(self) -> None:
        for assignment in self.scheduler.poll():
            waiter = self._waiters[assignment.replica].popleft()
            waiter.assignment = assignment
            waiter.event.set()


class Window:
    """At most ``limit`` samples admitted and not yet handed back: the bound of every queue."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._changed = anyio.Event()

    async def acquire(self, up_to: int) -> int:
        """Wait for room, then take as much as is free, at most ``up_to``."""
        while self.used >= self.limit:
            await self._changed.wait()
        n = min(up_to, self.limit - self.used)
        self.used += n
        return n

    def release(self, n: int) -> None:
        if n:
            self.used -= n
            self._changed.set()
            self._changed = anyio.Event()
