"""What a pipeline does when replicas or stored outputs are lost.

- A replica that dies holding shards is retired; its shards go back to their stage's queue
  and are cut again for the replicas left (``lost``).
- A stage output over 64 KiB stays in the object store of its replica's node. When that node
  goes away, a shard (or the delivery) that reads one fails with ``InputLostError``. The lost
  outputs are then computed again on the replicas left, in flow order, each stage from its own
  inputs, together with every output of the same samples computed from a lost one (so that a
  sample's fields stay consistent); then the shard is sent again (``recompute_lost``).

Either way a shard sent again counts as a retry, within ``PipelineConfig.max_retries`` per
sample and stage, and a sample is still counted once per stage. A sample that fails once more
fails the run, or is dropped alone (``ModelConfig.on_spent="drop"``): the stages that expected
it stop expecting it, and its run counts it as finished without delivering it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from .._core.errors import FlowError, InputLostError, ReplicaDiedError
from .._core.scheduling.scheduler import Assignment
from .._core.settings.config import ShardCall
from .calls import Hung

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._backends.abc import Backend
    from .._backends.specs import ReplicaHandle
    from .calls import ShardCaller
    from .inflight import SampleState
    from .parts import Parts

    Dropped = list[tuple[int, SampleState]]  # samples dropped, for their run to count as finished


class Recovery:
    """Shards that did not complete go back to their queue; outputs lost with a node are
    computed again."""

    def __init__(self, parts: Parts, call: ShardCaller) -> None:
        self._graph = parts.graph
        self._backend: Backend = parts.backend
        self._ledger = parts.ledger
        self._pools = parts.pools
        self._roster = parts.roster
        self._recorder = parts.recorder
        self._replacements = parts.replacements
        self._call = call
        self._recovering = anyio.Lock()  # a second shard that lost the same outputs finds them redone

    def lost(self, handle: ReplicaHandle, a: Assignment, err: ReplicaDiedError) -> Dropped:
        """The replica running shard ``a`` died (or hung and was stopped): the pool carries on
        without it, and the shard's samples are sent again; those dropped instead are returned
        (their run counts them as finished)."""
        back, gone = self._spend(handle, a, err)
        self.retire(handle, err, a.stage, a.ids)
        self._give_back(handle, a, back)
        return gone

    def retire(
        self, handle: ReplicaHandle, err: ReplicaDiedError, stage: str = "", ids: list[int] | None = None
    ) -> None:
        """``handle``'s process died (in a shard of ``stage``, or loading weights), or hung and
        was stopped: its pool carries on without it, and a replica is started in its place as
        ``Replacements`` says. The shards it still holds fail on their own and come back
        through ``lost``; ReplicaDiedError if it was the last replica of its model (and none is
        starting in place of a stopped one)."""
        pool = self._pools[handle.model]
        self._roster.died(handle)  # a weight sync skips it from now on
        if handle.replica_id in pool.scheduler.retired:
            return  # seen dead already (or being removed)
        pool.retire(handle.replica_id)
        if isinstance(err, Hung):
            self._replacements.hung(handle)
        else:
            self._replacements.died(handle)
        if not pool.scheduler.serving and not pool.replacing:
            raise ReplicaDiedError(
                f"{err.message}; every replica of model {handle.model!r} has died",
                stage or err.stage,
                handle.replica_id,
                err.sample_ids if ids is None else ids,
            ) from err

    def send_again(self, handle: ReplicaHandle, a: Assignment, err: FlowError) -> Dropped:
        """Shard ``a`` did not complete: its samples go back to the stage's queue, but those
        dropped, which are returned."""
        back, gone = self._spend(handle, a, err)
        self._give_back(handle, a, back)
        return gone

    def _give_back(self, handle: ReplicaHandle, a: Assignment, back: list[int]) -> None:
        self._ledger.retried(a.stage, back)
        self._recorder.retried(a.stage, len(back))
        dropped = [sid for sid in a.ids if sid not in back]
        self._pools[handle.model].give_back(a, self._ledger.costs(back) if back else [], dropped)

    def _spend(self, handle: ReplicaHandle, a: Assignment, err: FlowError) -> tuple[list[int], Dropped]:
        """The samples of shard ``a`` to send again, and those dropped. Those whose retries are
        spent fail the run, or, with ``ModelConfig.on_spent="drop"`` and a dead or hung replica,
        are dropped."""
        spent = self._ledger.spent(a.stage, a.ids)
        if not spent:
            return a.ids, []
        budget = self._ledger.max_retries
        note = f"samples {spent} were already retried PipelineConfig.max_retries={budget} times on this stage"
        if not isinstance(err, ReplicaDiedError):
            raise InputLostError(f"{err}; {note}") from err
        if self._graph.models[handle.model].config.on_spent == "fail":
            raise ReplicaDiedError(f"{err.message}; {note}", a.stage, handle.replica_id, a.ids) from err
        turns = dict(zip(spent, self._ledger.turns_of(a.stage, spent) or [0] * len(spent), strict=True))
        fresh, unseen, gone = self._ledger.drop(a.stage, spent)
        reason = f"{err.message} (retried {budget} times)"
        self._recorder.dropped(a.stage, fresh, [turns[sid] for sid in fresh], reason)
        for stage in unseen:  # a stage that waits for samples on their way must not wait for these
            pool = self._pools[self._graph.stages[stage].model]
            pool.scheduler.expect(stage, -1)
            pool.scheduler.admit(stage, -1)
        for model in {self._graph.stages[stage].model for stage in unseen}:
            self._pools[model].pump()
        return [sid for sid in a.ids if sid not in spent], gone

    async def recompute_lost(self, states: Mapping[int, SampleState]) -> int:
        """Compute again the outputs of ``states`` lost with a node that is gone, and those
        computed from them; returns how many sample outputs were computed again."""
        async with self._recovering:
            dead = self._backend.dead_nodes()
            redo = self._to_redo(states, dead)
            try:
                for stage, sids in redo.items():
                    await self._redo(stage, sids, states, dead)
            except ReplicaDiedError as err:  # not the caller's replica: it must not be retired for it
                raise InputLostError(f"outputs lost with their node could not be computed again: {err}") from err
            return sum(len(sids) for sids in redo.values())

    def _to_redo(self, states: Mapping[int, SampleState], dead: set[str]) -> dict[str, list[int]]:
        """Per stage, in flow order: the samples whose output there is lost or was computed
        from a lost one."""
        if not dead:
            return {}
        out: dict[str, list[int]] = {}
        for sid, state in states.items():
            redone: set[str] = set()
            for stage, spec in self._graph.stages.items():  # flow order: inputs come first
                if stage not in state.done:
                    continue
                lost = state.node.get(stage) in dead and self._backend.stored(state.loc[stage][0])
                if lost or any(i in redone for i in spec.inputs):
                    if stage in self._graph.loop_of:
                        raise InputLostError(
                            f"sample {sid}: the output of stage {stage!r}, inside loop "
                            f"{self._graph.loop_of[stage].name!r}, was lost with its node; turns of a loop "
                            "are not computed again (not supported yet)"
                        )
                    redone.add(stage)
                    out.setdefault(stage, []).append(sid)
        return {stage: out[stage] for stage in self._graph.stages if stage in out}

    async def _redo(self, stage: str, sids: list[int], states: Mapping[int, SampleState], dead: set[str]) -> None:
        spec = self._graph.stages[stage]
        runs: dict[int, list[int]] = {}
        for sid in sids:  # a step's ``iteration`` is its run's number
            runs.setdefault(states[sid].run.index, []).append(sid)
        for iteration, ids in runs.items():
            handle = self._replica_left(spec.model, stage, ids, dead)
            call = ShardCall(
                stage=stage,
                method=spec.method,
                iteration=iteration,
                ids=ids,
                pieces=self._ledger.pieces(stage, ids, states),
            )
            meta, out = await self._call(handle, call)
            self._ledger.check_output(Assignment(handle.replica_id, stage, ids), handle, meta)
            self._recorder.retried(stage, len(ids))
            for row, sid in enumerate(ids):
                states[sid].loc[stage] = (out, row)
                states[sid].node[stage] = handle.node_id

    def _replica_left(self, model: str, stage: str, ids: list[int], dead: set[str]) -> ReplicaHandle:
        scheduler = self._pools[model].scheduler
        left = [
            h
            for h in self._roster.handles
            if h.model == model and h.replica_id not in scheduler.retired and h.node_id not in dead
        ]
        if not left:
            raise ReplicaDiedError(
                f"outputs lost with their node must be computed again, but no replica of model {model!r} is left",
                stage,
                -1,
                ids,
            )
        return min(left, key=lambda h: scheduler.in_flight[h.replica_id])
