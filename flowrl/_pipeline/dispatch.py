"""The dispatcher: each replica's slots pull shards and run them, and their outputs are joined.

A replica runs ``prefetch`` slots. A slot asks its pool for a shard, waits until the scheduler
cuts one for it, sends it, records what the replica reports, and hands the output to the
ledger, which says which stages may now take which samples. Payloads never pass through here,
only references.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio

from .._core.errors import InputLostError, ReplicaDiedError
from .pools import Retired

if TYPE_CHECKING:
    from .._backends.specs import ReplicaHandle
    from .._core.scheduling.scheduler import Assignment
    from .._core.settings.config import CallMeta
    from .calls import ShardCaller
    from .parts import Parts
    from .recovery import Recovery
    from .runs import Runs

Key = tuple[str, int]  # (model, replica)


class Dispatcher:
    """Starts and ends the slots of every replica; a slot runs shards until its replica leaves."""

    def __init__(self, parts: Parts, call: ShardCaller, recovery: Recovery, runs: Runs) -> None:
        self._graph = parts.graph
        self._pools = parts.pools
        self._ledger = parts.ledger
        self._call = call
        self._recovery = recovery
        self._runs = runs
        self._roster = parts.roster
        self._recorder = parts.recorder
        self._timeline = parts.timeline
        self._supervisor = parts.supervisor
        self._replacements = parts.replacements
        self._slots: dict[Key, int] = {}  # slots running per replica
        self._left: dict[Key, anyio.Event] = {}  # replicas being removed: set once their slots end

    def serve(self, handle: ReplicaHandle) -> None:
        """Start the replica's slots (``ModelConfig.prefetch`` of them)."""
        key = (handle.model, handle.replica_id)
        for _ in range(self._graph.models[handle.model].config.prefetch):
            self._slots[key] = self._slots.get(key, 0) + 1
            self._supervisor.start_soon(self._slot, handle)

    def slots_ended(self, model: str, replica: int) -> anyio.Event | None:
        """An event set once every slot of a retired replica has ended; None if none runs."""
        key = (model, replica)
        if not self._slots.get(key, 0):
            return None
        return self._left.setdefault(key, anyio.Event())

    async def _slot(self, handle: ReplicaHandle) -> None:
        pool, r = self._pools[handle.model], handle.replica_id
        try:
            while True:
                assignment = await pool.next(r)
                self._roster.fed(handle.model, r)
                try:
                    if await self._execute(handle, assignment):
                        pool.finish(assignment)
                        self._replacements.served(handle.model, r)
                except ReplicaDiedError as err:
                    self._runs.dropped(self._recovery.lost(handle, assignment, err))
                    return
                if not pool.scheduler.in_flight[r]:  # nothing left to run: starved from now on
                    self._roster.hungry(handle.model, r)
        except Retired:  # its replica died or was removed while this slot waited
            return
        except Exception as err:
            self._supervisor.fail(err)
            raise
        finally:
            self._slot_left(handle)

    def _slot_left(self, handle: ReplicaHandle) -> None:
        key = (handle.model, handle.replica_id)
        self._slots[key] -= 1
        if not self._slots[key] and key in self._left:
            self._left.pop(key).set()

    async def _execute(self, handle: ReplicaHandle, a: Assignment) -> bool:
        """Run shard ``a``; False when it must be sent again (its inputs were lost and computed again)."""
        spec = self._graph.stages[a.stage]
        iteration = self._ledger.samples[a.ids[0]].run.index
        call = self._ledger.shard_call(a.stage, spec.method, iteration, a.ids)
        scheduler = self._pools[spec.model].scheduler
        # A call's time outside the step tells its overhead only if no other shard of its
        # replica was in flight meanwhile (one queued ahead would be counted as overhead).
        ahead = scheduler.in_flight[handle.replica_id] - 1
        alone = ahead == 0
        start = time.perf_counter()
        try:
            meta, out_ref = await self._call(handle, call, ahead)
        except InputLostError as err:
            redone = await self._recovery.recompute_lost({sid: self._ledger.samples[sid] for sid in a.ids})
            if not redone and self._ledger.pieces(a.stage, a.ids) == call.pieces:
                raise  # not lost with a node that is gone (nor computed again by another shard meanwhile)
            self._runs.dropped(self._recovery.send_again(handle, a, err))
            return False
        latency = time.perf_counter() - start
        self._ledger.check_output(a, handle, meta)
        self._recorder.record(a.stage, handle.replica_id, meta, latency)
        turns = self._ledger.turns_of(a.stage, a.ids)
        self._timeline.shard(handle.model, handle.replica_id, a.stage, meta.started, meta.step_s, a.ids, turns)
        alone = alone and scheduler.in_flight[handle.replica_id] == 1
        overhead = latency - meta.busy_s if alone else None
        scheduler.measure(a.stage, meta.rows, meta.busy_s, overhead, meta.steps, meta.shard_s, handle.replica_id)
        self._complete(a.stage, a.ids, out_ref, handle.node_id, meta)
        return True

    def _complete(self, stage: str, ids: list[int], out_ref: Any, node: str, meta: CallMeta) -> None:
        done = self._ledger.complete(stage, ids, out_ref, node, meta.stops, meta.version)
        for loop, sids in done.again.items():  # another turn: its stages will see them once more
            for name in self._graph.loops[loop].body:
                scheduler = self._pools[self._graph.stages[name].model].scheduler
                scheduler.expect(name, len(sids))
                scheduler.admit(name, len(sids))
        for name, sids in done.ready.items():
            self._pools[self._graph.stages[name].model].ready(name, sids, self._ledger.costs(sids))
        for loop, turns, why in done.left:
            self._recorder.left_loop(loop, turns, why)
        self._runs.finished(done.finished)
        if done.dropped:
            self._runs.dropped(done.dropped)
