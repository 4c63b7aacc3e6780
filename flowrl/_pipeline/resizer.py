"""Resizer: replicas added to and removed from the pools while runs go on.

A replica added starts its actor, is handed the pool's current weights (``Joining.prepare``, under
``Joining.lock`` so that a weight sync in progress sees it either before or after), then its
slots pull shards like the others'. A replica removed is retired in the scheduler first: it is
cut no new shard, finishes the ones it holds, and its actor stops once its slots have left, so
no sample is lost or run twice.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import anyio

from .._core import checks
from .._core.errors import ConfigError, FlowError, ReplicaDiedError
from .._core.scheduling.autoscale import ScaleEvent

if TYPE_CHECKING:
    from .._backends.abc import Cluster
    from .._backends.specs import ReplicaHandle
    from .._core.scheduling.autoscale import Reading
    from .dispatch import Dispatcher
    from .parts import Parts, Replacement
    from .pools import AsyncPool
    from .runs import Runs

log = logging.getLogger("flowrl")
AUTOSCALE = "autoscale"  # the timeline group of resize events


class Resizer:
    """Grows and shrinks the pools; a replica added joins as ``Parts.joining`` says."""

    def __init__(self, parts: Parts, dispatcher: Dispatcher, runs: Runs) -> None:
        self._graph = parts.graph
        self._cluster: Cluster = parts.backend
        self._pools = parts.pools
        self._roster = parts.roster
        self._dispatcher = dispatcher
        self._runs = runs
        self._recorder = parts.recorder
        self._timeline = parts.timeline
        self._supervisor = parts.supervisor
        self._replacements = parts.replacements
        self.joining = parts.joining
        self.scale_events: list[ScaleEvent] = []
        self._resizing = anyio.Lock()

    def serving(self, model: str) -> list[int]:
        """The replicas of ``model`` serving now (neither removed nor dead)."""
        return self._pool_of(model).scheduler.serving_ids()

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
            s = self._pool_of(model).scheduler
            before = s.serving + len(s.joining)  # those starting count: they join whatever happens here
            if replicas > before:
                return await self._add(model, replicas - before, reason, reading)
            if replicas < before:
                return await self._remove(model, before - replicas, reason, reading)
            return []

    def _note(self, event: ScaleEvent) -> None:
        self.scale_events.append(event)
        measured = {} if event.reading is None else {"queued": event.reading.queued, "starved": event.reading.starved}
        self._timeline.add(
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

    async def replace(self) -> None:
        """For the pipeline's life, start a replica in the background for each one stopped
        (``Replacements``: a replica that died, or whose call hung past ``call_timeout_s`` with
        ``on_timeout="retry"``), or report that none is started."""
        async for request in self._replacements.requests:
            if request.delay_s is None:
                self._left_out(request.model, request.reason)
            else:
                self._supervisor.start_soon(self._replace, request)

    def _left_out(self, model: str, reason: str) -> None:
        log.warning("%s", reason)
        now = len(self.serving(model))
        self._note(
            ScaleEvent(model=model, action="left out", before=now + 1, after=now, reason=reason, time=time.time())
        )

    async def _replace(self, request: Replacement) -> None:
        model, why = request.model, ""
        try:
            await anyio.sleep(request.delay_s or 0.0)  # Healing's backoff: a line that keeps dying waits longer
            if self._supervisor.closed:
                return  # the pipeline closed before its turn: no replica is needed any more
            # not under ``_resizing``: replacements start side by side, each on an id of its own
            (new,) = await self._add(model, 1, request.reason, None, since=request.noticed, replaces=request.old)
            self._replacements.policies[model].replaced(request.old, new)
        except FlowError as err:  # no room left for it, or its setup or weights failed: again, within limits
            failed = f"{type(err).__name__}: {err}"
            stop = self._replacements.start_failed(request, failed)
            if stop is None:
                log.warning(
                    "replica %d of %r: its replacement failed to start (%s); trying again", request.old, model, failed
                )
            else:
                why = f"no replacement could start ({failed})"
                self._left_out(model, f"replica {request.old} of {model!r} died and {why}; {stop}")
        except Exception as err:
            self._supervisor.fail(err)
            raise
        finally:
            self._replacements.finished(model)
        pool = self._pools[model]
        if why and not pool.scheduler.serving and not pool.replacing:
            # the runs waiting on this pool would wait for ever: they fail, as when its last replica died
            stage = next(name for name, spec in self._graph.stages.items() if spec.model == model)
            self._supervisor.fail(
                ReplicaDiedError(f"every replica of model {model!r} has died and {why}", stage, request.old, [])
            )

    async def add_replicas(self, model: str, count: int = 1) -> list[int]:
        """Start ``count`` replicas of ``model``; they pull shards as soon as they are set up."""
        checks.count(count, f"add_replicas({model!r}, count)")
        async with self._resizing:
            return await self._add(model, count, "requested", None)

    async def _add(
        self,
        model: str,
        count: int,
        reason: str,
        reading: Reading | None,
        since: float | None = None,
        replaces: int | None = None,
    ) -> list[int]:
        """``since`` and ``replaces``: a replacement's, when the replica it replaces was stopped and
        which one that was."""
        self._supervisor.raise_if_failed()
        pool = self._pool_of(model)
        if count < 1:
            raise ConfigError(f"add_replicas({model!r}, {count}): count must be >= 1")
        ids = [pool.add_replica(joining=True) for _ in range(count)]  # taken now; ids are never reused
        handles: list[ReplicaHandle] = []
        try:
            handles = sorted(
                await self._cluster.start([self.joining.spec(self._graph.models[model], r, replaces) for r in ids]),
                key=lambda h: h.replica_id,
            )
            async with self.joining.lock:
                before = len(self.serving(model))
                for handle in handles:
                    if self.joining.prepare is not None:
                        await self.joining.prepare(handle)
                    self._serve(handle)
        except BaseException:
            with anyio.CancelScope(shield=True):  # those that could not join stop now, not at close
                await self._cluster.stop([h for h in handles if h.replica_id in pool.scheduler.joining])
            for r in ids:
                if r in pool.scheduler.joining:
                    pool.retire(r)  # never joined: its start failed
            raise
        self._changed(model, "grow", before, reason, reading, since)
        return ids

    def _changed(
        self, model: str, action: str, before: int, reason: str, reading: Reading | None, since: float | None = None
    ) -> None:
        now = time.time()
        self._note(
            ScaleEvent(
                model=model,
                action=action,
                before=before,
                after=len(self.serving(model)),
                reason=reason,
                time=now,
                reading=reading,
                recovery_s=None if since is None else now - since,
            )
        )

    def _serve(self, handle: ReplicaHandle) -> None:
        self._pools[handle.model].scheduler.join(handle.replica_id)
        self._recorder.add_replica(handle.model, handle.replica_id, self._runs.active_now())
        self._roster.join(handle)
        self._dispatcher.serve(handle)

    async def remove_replicas(self, model: str, count: int = 1) -> list[int]:
        """Stop ``count`` replicas of ``model`` (the least busy, then the newest): each is cut no
        new shard, finishes those it holds, then its actor stops."""
        checks.count(count, f"remove_replicas({model!r}, count)")
        async with self._resizing:
            return await self._remove(model, count, "requested", None)

    async def _remove(self, model: str, count: int, reason: str, reading: Reading | None) -> list[int]:
        self._supervisor.raise_if_failed()
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
            ended = self._dispatcher.slots_ended(model, r)
            if ended is not None:
                left.append(ended)
            pool.retire(r)
        for event in left:
            await event.wait()
        async with self.joining.lock:  # a weight sync sends to the replicas listed
            gone = self._roster.leave(model, chosen)
        for r in chosen:
            self._recorder.remove_replica(model, r, self._runs.active_now())
        await self._cluster.stop(gone)
        self._changed(model, "shrink", len(serving), reason, reading)
        return sorted(chosen)
