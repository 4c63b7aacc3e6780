"""What a pipeline does when replicas or stored outputs are lost (layer 5).

- A replica that dies holding shards is retired; its shards go back to their stage's queue
  and are cut again for the replicas left (``_lost``).
- A stage output over 64 KiB stays in the object store of its replica's node. When that node
  goes away, a shard (or the delivery) that reads one fails with ``InputLostError``. The lost
  outputs are then computed again on the replicas left, in flow order, each stage from its own
  inputs, together with every output of the same samples computed from a lost one (so that a
  sample's fields stay consistent); then the shard is sent again (``_recompute_lost``).

Either way a shard sent again counts as a retry, within ``PipelineConfig.max_retries`` per
sample and stage, and a sample is still counted once per stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._core.config import CallMeta, PipelineConfig, ShardCall
from .._core.errors import FlowError, InputLostError, ReplicaDiedError
from .._core.scheduler import Assignment

if TYPE_CHECKING:
    from collections.abc import Mapping

    import anyio

    from .._backends.abc import Backend
    from .._backends.specs import ReplicaHandle
    from .._core.graph import FlowGraph
    from .._core.stats import StatsRecorder
    from .pipeline import _SampleState
    from .pools import AsyncPool


class RecoveryMixin:
    graph: FlowGraph
    config: PipelineConfig
    _backend: Backend
    _handles: list[ReplicaHandle]
    _pools: dict[str, AsyncPool]
    _recorder: StatsRecorder
    _samples: dict[int, _SampleState]
    _retries: dict[tuple[str, int], int]
    _recovering: anyio.Lock

    async def _call(self, handle: ReplicaHandle, call: ShardCall) -> tuple[CallMeta, Any]:
        raise NotImplementedError

    def _pieces(self, stage: str, ids: list[int], states: Mapping[int, _SampleState] | None = None) -> list[Any]:
        raise NotImplementedError

    def _check_output(self, a: Assignment, handle: ReplicaHandle, meta: CallMeta) -> None:
        raise NotImplementedError

    def _lost(self, handle: ReplicaHandle, a: Assignment, err: ReplicaDiedError) -> None:
        """The replica running shard ``a`` died: the pool carries on without it."""
        pool = self._pools[handle.model]
        if handle.replica_id not in pool.scheduler.retired:
            self._check_budget(handle, a, err)
            pool.retire(handle.replica_id)
            if not pool.scheduler.serving:
                raise ReplicaDiedError(
                    f"{err.message}; every replica of model {handle.model!r} has died",
                    a.stage,
                    handle.replica_id,
                    a.ids,
                ) from err
        self._send_again(handle, a, err)

    def _send_again(self, handle: ReplicaHandle, a: Assignment, err: FlowError) -> None:
        """Shard ``a`` did not complete: its samples go back to the stage's queue."""
        self._check_budget(handle, a, err)
        for sid in a.ids:
            self._retries[(a.stage, sid)] = self._retries.get((a.stage, sid), 0) + 1
        self._recorder.retried(a.stage, len(a.ids))
        costs = [self._samples[sid].cost for sid in a.ids] if self.config.cost_field else None
        self._pools[handle.model].give_back(a, costs)

    def _check_budget(self, handle: ReplicaHandle, a: Assignment, err: FlowError) -> None:
        budget = self.config.max_retries
        spent = [sid for sid in a.ids if self._retries.get((a.stage, sid), 0) >= budget]
        if not spent:
            return
        note = f"samples {spent} were already retried PipelineConfig.max_retries={budget} times on this stage"
        if isinstance(err, ReplicaDiedError):
            raise ReplicaDiedError(f"{err.message}; {note}", a.stage, handle.replica_id, a.ids) from err
        raise InputLostError(f"{err}; {note}") from err

    async def _recompute_lost(self, states: Mapping[int, _SampleState]) -> int:
        """Compute again the outputs of ``states`` lost with a node that is gone, and those
        computed from them; returns how many sample outputs were computed again."""
        async with self._recovering:  # a second shard that lost the same outputs finds them redone
            dead = self._backend.dead_nodes()
            redo = self._to_redo(states, dead)
            try:
                for stage, sids in redo.items():
                    await self._redo(stage, sids, states, dead)
            except ReplicaDiedError as err:  # not the caller's replica: it must not be retired for it
                raise InputLostError(f"outputs lost with their node could not be computed again: {err}") from err
            return sum(len(sids) for sids in redo.values())

    def _to_redo(self, states: Mapping[int, _SampleState], dead: set[str]) -> dict[str, list[int]]:
        """Per stage, in flow order: the samples whose output there is lost or was computed
        from a lost one."""
        if not dead:
            return {}
        out: dict[str, list[int]] = {}
        for sid, state in states.items():
            redone: set[str] = set()
            for stage, spec in self.graph.stages.items():  # flow order: inputs come first
                if stage not in state.done:
                    continue
                lost = state.node.get(stage) in dead and self._backend.stored(state.loc[stage][0])
                if lost or any(i in redone for i in spec.inputs):
                    redone.add(stage)
                    out.setdefault(stage, []).append(sid)
        return {stage: out[stage] for stage in self.graph.stages if stage in out}

    async def _redo(self, stage: str, sids: list[int], states: Mapping[int, _SampleState], dead: set[str]) -> None:
        spec = self.graph.stages[stage]
        runs: dict[int, list[int]] = {}
        for sid in sids:  # a step's ``iteration`` is its run's number
            runs.setdefault(states[sid].run.index, []).append(sid)
        for iteration, ids in runs.items():
            handle = self._replica_left(spec.model, stage, ids, dead)
            call = ShardCall(
                stage=stage, method=spec.method, iteration=iteration, ids=ids, pieces=self._pieces(stage, ids, states)
            )
            meta, out = await self._call(handle, call)
            self._check_output(Assignment(handle.replica_id, stage, ids), handle, meta)
            self._recorder.retried(stage, len(ids))
            for row, sid in enumerate(ids):
                states[sid].loc[stage] = (out, row)
                states[sid].node[stage] = handle.node_id

    def _replica_left(self, model: str, stage: str, ids: list[int], dead: set[str]) -> ReplicaHandle:
        scheduler = self._pools[model].scheduler
        left = [
            h
            for h in self._handles
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
