"""Elastic pools (layer 5): replicas added and removed while runs go on, and the autoscaler.

A replica added starts its actor, is handed the pool's current weights (``join_hook``, under
``members_lock`` so that a weight sync in progress sees it either before or after), then its
slots pull shards like the others'. A replica removed is retired in the scheduler first: it is
cut no new shard, finishes the ones it holds, and its actor stops once its slots have left, so
no sample is lost or run twice. Mixed into ``AsyncPipeline``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import anyio

from .._core.autoscale import AutoscalePolicy, Reading, ScaleEvent
from .._core.errors import ConfigError, FlowError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from anyio.abc import TaskGroup

    from .._backends.abc import Backend
    from .._backends.specs import ReplicaHandle, ReplicaSpec
    from .._core.graph import FlowGraph
    from .._core.model import Model
    from .._core.stats import StatsRecorder
    from .._core.trace import Timeline
    from .pools import AsyncPool

log = logging.getLogger("flowrl")
AUTOSCALE = "autoscale"  # the timeline group of resize events


class ElasticMixin:
    graph: FlowGraph
    _backend: Backend
    _handles: list[ReplicaHandle]
    _pools: dict[str, AsyncPool]
    _recorder: StatsRecorder
    _hungry: dict[tuple[str, int], float]
    _tg: TaskGroup | None
    timeline: Timeline
    grow_spec: Callable[[Model, int], ReplicaSpec]
    join_hook: Callable[[ReplicaHandle], Awaitable[None]] | None
    members_lock: anyio.Lock
    scale_events: list[ScaleEvent]
    _slots: dict[tuple[str, int], int]
    _left: dict[tuple[str, int], anyio.Event]
    _resizing: anyio.Lock

    def _raise_if_failed(self) -> None:
        raise NotImplementedError

    def _active_now(self) -> float:
        raise NotImplementedError

    def _running(self) -> bool:
        raise NotImplementedError

    async def _slot(self, handle: ReplicaHandle) -> None:
        raise NotImplementedError

    def serving(self, model: str) -> list[int]:
        """The replicas of ``model`` serving now (neither removed nor dead)."""
        s = self._pool_of(model).scheduler
        return [r for r in range(s.replicas) if r not in s.retired]

    def _pool_of(self, model: str) -> AsyncPool:
        if model not in self._pools:
            raise ConfigError(f"no model {model!r} in this pipeline; its models are {sorted(self._pools)}")
        return self._pools[model]

    async def resize(
        self, model: str, replicas: int, *, reason: str = "requested", reading: Reading | None = None
    ) -> list[int]:
        """Grow or shrink ``model``'s pool to ``replicas`` serving; the ids added or removed."""
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1:
            raise ConfigError(f"resize({model!r}, {replicas!r}): a pool needs at least 1 replica")
        async with self._resizing:
            before = len(self.serving(model))
            if replicas > before:
                return await self._add(model, replicas - before, reason, reading)
            if replicas < before:
                return await self._remove(model, before - replicas, reason, reading)
            return []

    def _note(self, event: ScaleEvent) -> None:
        self.scale_events.append(event)
        measured = {} if event.reading is None else {"queued": event.reading.queued, "starved": event.reading.starved}
        self.timeline.add(
            AUTOSCALE,
            0,
            f"{event.action} {event.model}",
            event.time,
            event.time,
            before=event.before,
            after=event.after,
            reason=event.reason,
            **measured,
        )
        log.info("%s %s: %d -> %d replicas (%s)", event.action, event.model, event.before, event.after, event.reason)

    async def add_replicas(self, model: str, count: int = 1) -> list[int]:
        """Start ``count`` replicas of ``model``; they pull shards as soon as they are set up."""
        async with self._resizing:
            return await self._add(model, count, "requested", None)

    async def _add(self, model: str, count: int, reason: str, reading: Reading | None) -> list[int]:
        self._raise_if_failed()
        pool = self._pool_of(model)
        if count < 1:
            raise ConfigError(f"add_replicas({model!r}, {count}): count must be >= 1")
        first, before = pool.scheduler.replicas, len(self.serving(model))  # ids are never reused
        handles = await self._backend.start(
            [self.grow_spec(self.graph.models[model], r) for r in range(first, first + count)]
        )
        joining, served = sorted(handles, key=lambda h: h.replica_id), 0
        try:
            async with self.members_lock:
                for handle in joining:
                    if self.join_hook is not None:
                        await self.join_hook(handle)
                    self._serve(handle)
                    served += 1
        except BaseException:
            with anyio.CancelScope(shield=True):  # those that could not join stop now, not at close
                await self._backend.stop(joining[served:])
            raise
        self._changed(model, "grow", before, reason, reading)
        return [h.replica_id for h in handles]

    def _changed(self, model: str, action: str, before: int, reason: str, reading: Reading | None) -> None:
        self._note(
            ScaleEvent(
                model=model,
                action=action,
                before=before,
                after=len(self.serving(model)),
                reason=reason,
                time=time.time(),
                reading=reading,
            )
        )

    def _serve(self, handle: ReplicaHandle) -> None:
        r = self._pools[handle.model].add_replica()
        if r != handle.replica_id:
            raise FlowError(f"internal: replica {handle.replica_id} of {handle.model!r} joined as {r}")
        self._recorder.add_replica(handle.model, self._active_now())
        self._handles.append(handle)
        self._hungry[(handle.model, r)] = time.perf_counter()
        assert self._tg is not None
        for _ in range(self.graph.models[handle.model].config.prefetch):
            self._start_slot(handle)

    def _start_slot(self, handle: ReplicaHandle) -> None:
        key = (handle.model, handle.replica_id)
        self._slots[key] = self._slots.get(key, 0) + 1
        assert self._tg is not None
        self._tg.start_soon(self._slot, handle)

    def _slot_left(self, handle: ReplicaHandle) -> None:
        key = (handle.model, handle.replica_id)
        self._slots[key] -= 1
        if not self._slots[key] and key in self._left:
            self._left.pop(key).set()

    async def remove_replicas(self, model: str, count: int = 1) -> list[int]:
        """Stop ``count`` replicas of ``model`` (the least busy, then the newest): each is cut no
        new shard, finishes those it holds, then its actor stops."""
        async with self._resizing:
            return await self._remove(model, count, "requested", None)

    async def _remove(self, model: str, count: int, reason: str, reading: Reading | None) -> list[int]:
        self._raise_if_failed()
        pool = self._pool_of(model)
        serving, s = self.serving(model), pool.scheduler
        if not 1 <= count < len(serving):
            raise ConfigError(
                f"remove_replicas({model!r}, {count}): {len(serving)} replicas serve; at least one "
                "must stay and count must be >= 1"
            )
        chosen = sorted(serving, key=lambda r: (s.in_flight[r], -r))[:count]
        left = []
        for r in chosen:
            if self._slots.get((model, r), 0):
                left.append(self._left.setdefault((model, r), anyio.Event()))
            pool.retire(r)
        for event in left:
            await event.wait()
        gone = [h for h in self._handles if h.model == model and h.replica_id in chosen]
        async with self.members_lock:  # a weight sync sends to the replicas listed
            self._handles = [h for h in self._handles if h not in gone]
        for r in chosen:
            since = self._hungry.pop((model, r), None)
            if since is not None:
                self._recorder.starved(model, r, time.perf_counter() - since)
            self._recorder.remove_replica(model, r, self._active_now())
        await self._backend.stop(gone)
        self._changed(model, "shrink", len(serving), reason, reading)
        return sorted(chosen)

    # ---- the autoscaler ----
    async def _autoscale(self) -> None:
        configs = {n: m.config.autoscale for n, m in self.graph.models.items() if m.config.autoscale is not None}
        policy = AutoscalePolicy(configs)  # type: ignore[arg-type]
        every = min(c.every_s for c in configs.values())  # type: ignore[union-attr]
        last = self._starvation(configs)
        while True:
            await anyio.sleep(every)  # a control loop's period
            now = self._starvation(configs)
            if not self._running():
                policy.reset()
            else:
                readings = [self._reading(n, last[n], now[n]) for n in configs]
                for event in policy.decide(readings, await self._backend.free()):
                    try:
                        await self.resize(event.model, event.after, reason=event.reason, reading=event.reading)
                    except FlowError as err:  # e.g. no room after all: the run goes on as it is
                        log.warning(
                            "autoscaler: could not %s %s to %d replicas: %s",
                            event.action,
                            event.model,
                            event.after,
                            err,
                        )
            last = now

    def _starvation(self, models: Any) -> dict[str, tuple[float, float]]:
        """Per model: (now, starved seconds so far, open intervals included)."""
        now = time.perf_counter()
        out = {}
        for name in models:
            retired = self._pools[name].scheduler.retired  # a dead replica is not starved
            open_s = sum(now - since for (m, r), since in self._hungry.items() if m == name and r not in retired)
            out[name] = (now, self._recorder.starved_s(name) + open_s)
        return out

    def _reading(self, model: str, before: tuple[float, float], after: tuple[float, float]) -> Reading:
        serving = len(self.serving(model))
        elapsed = max(1e-9, after[0] - before[0]) * serving
        queued = sum(q for q, _ in self._pools[model].scheduler.queues().values())
        spec = self.grow_spec(self.graph.models[model], 0)
        return Reading(
            model=model,
            serving=serving,
            queued=queued,
            starved=min(1.0, (after[1] - before[1]) / elapsed),
            batch_size=self.graph.models[model].config.batch_size,
            cpus=spec.num_cpus,
            gpus=spec.num_gpus,
        )
