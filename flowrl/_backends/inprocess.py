"""The in-process backend: same semantics as Ray, one process, breakpoints work.

Each replica is a deep copy of the driver's model instance. Calls run inline on the event
loop (``threads=False``, the debugging mode: ``breakpoint()`` in a step just works) or in
worker threads so replicas overlap (``threads=True``). A replica runs one shard at a time.
"""

from __future__ import annotations

import copy
import logging
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from .._core.errors import ConfigError, FlowError, ReplicaDiedError
from .replica import ReplicaRuntime
from .specs import DEBUG_ENV, ActorCounts, ReplicaHandle, ReplicaSpec, debugging
from .trainer_runtime import TrainerRuntime
from .weight_share import Broadcast, Group

if TYPE_CHECKING:
    from .._core.flow.batch import Batch
    from .._core.settings.config import CallMeta, ShardCall

log = logging.getLogger("flowrl")
T = TypeVar("T")


class LocalRef(Generic[T]):
    """A stand-in for an object reference: holds the value itself."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value


def _fetch(refs: list[LocalRef[Batch]]) -> list[Batch]:
    return [r.value for r in refs]


class _LocalReplica:
    def __init__(self, runtime: ReplicaRuntime) -> None:
        self.runtime = runtime
        self.lock = anyio.Lock()
        self.stopped = False  # a stopped replica's thread may still run a call that hung: it takes no more


def _trainer(rank: ReplicaHandle) -> TrainerRuntime:
    runtime: TrainerRuntime = rank.ref  # what start_trainer put in the handle
    return runtime


class InProcessBackend:
    def __init__(self, *, threads: bool = False, deterministic: bool = False) -> None:
        self.threads = threads
        self.deterministic = deterministic  # torch's deterministic algorithms: process-wide here
        self.counts = ActorCounts()
        self._replicas: list[_LocalReplica] = []

    async def prepare(self, specs: list[ReplicaSpec]) -> None:
        pass

    async def start(self, specs: list[ReplicaSpec]) -> list[ReplicaHandle]:
        handles = []
        for spec in specs:
            runtime = ReplicaRuntime(copy.deepcopy(spec.model), spec.replica_id, self.deterministic)
            runtime.setup(gpu_ids=[], node_id="local")
            replica = _LocalReplica(runtime)
            self._replicas.append(replica)
            handles.append(ReplicaHandle(spec.model.name, spec.replica_id, "local", replica))
            self.counts.started(spec.model.name)
        return handles

    def put(self, batch: Batch) -> LocalRef[Batch]:
        return LocalRef(batch)

    async def call(self, replica: ReplicaHandle, call: ShardCall) -> tuple[CallMeta, Any]:
        local: _LocalReplica = replica.ref
        async with local.lock:
            if local.stopped:
                raise ReplicaDiedError("the replica was stopped", call.stage, replica.replica_id, call.ids)
            if self.threads:
                meta, out = await anyio.to_thread.run_sync(local.runtime.run, call, _fetch, abandon_on_cancel=True)
            else:
                meta, out = local.runtime.run(call, _fetch)
                await anyio.lowlevel.checkpoint()
        return meta, LocalRef(out.copy())  # the model may reuse the buffers it returned

    async def fetch(self, refs: list[Any]) -> list[Batch]:
        return _fetch(refs)

    async def start_trainer(self, specs: list[ReplicaSpec], timeout_s: float) -> list[ReplicaHandle]:
        if len(specs) != 1:
            name = specs[0].model.name
            if not debugging():
                raise ConfigError(
                    f"trainer {name!r} has {len(specs)} data-parallel ranks; the in-process backend runs one "
                    "(set its num_replicas to 1, or use the Ray backend)"
                )
            # one rank computes what the group would: losses are normalised by the global batch
            log.warning("%s=1: trainer %r runs as one rank instead of %d", DEBUG_ENV, name, len(specs))
        runtime = TrainerRuntime(copy.deepcopy(specs[0].model), 0, 1, self.deterministic)
        runtime.setup(None, [], "local", timeout_s)
        self.counts.started(specs[0].model.name)
        return [ReplicaHandle(specs[0].model.name, 0, "local", runtime)]

    async def train(
        self, rank: ReplicaHandle, shard: Any, ids: list[int], step_size: int, micro_batch: int, iteration: int
    ) -> dict[str, Any]:
        self.counts.training_started(rank.model)
        try:
            return _trainer(rank).train(shard.value, step_size, micro_batch, iteration)
        finally:
            self.counts.training_ended(rank.model)

    async def get_weights(self, rank: ReplicaHandle) -> LocalRef[object]:
        holder: _LocalReplica | TrainerRuntime = rank.ref  # a replica's, or a trainer rank's
        weights: object
        if isinstance(holder, _LocalReplica):
            weights = holder.runtime.get_weights()
        else:
            weights = holder.get_weights()
            if isinstance(weights, Broadcast):  # one process: the snapshot itself, no broadcast
                weights = holder.weight_values(weights.snapshot)
        # a copy: the arrays may be views of the live parameters, which training goes on changing
        return LocalRef(copy.deepcopy(weights))

    async def save_state(self, rank: ReplicaHandle, alone: bool = False) -> tuple[bytes | None, bytes]:
        return _trainer(rank).save_state(alone)

    async def load_state(self, rank: ReplicaHandle, model: bytes, rng: bytes | None) -> None:
        _trainer(rank).load_state(model, rng)

    async def value(self, ref: Any) -> Any:
        return ref.value

    def share(self, value: T) -> LocalRef[T]:
        return LocalRef(value)

    def stored(self, ref: Any) -> bool:
        return False

    def dead_nodes(self) -> set[str]:
        return set()

    def export_metrics(self, values: list[tuple[str, str, dict[str, str], float]]) -> None:
        pass  # no Ray: nothing to export to

    async def alive(self, handle: ReplicaHandle) -> bool:
        return True  # it is this process

    async def stop(self, handles: list[ReplicaHandle]) -> None:
        gone = {id(h.ref) for h in handles}
        for handle in handles:
            if isinstance(handle.ref, _LocalReplica):
                handle.ref.stopped = True
        self._replicas = [r for r in self._replicas if id(r) not in gone]

    async def free(self) -> dict[str, float]:
        return {"CPU": float("inf"), "GPU": float("inf")}  # this process: no resources to count

    async def load_weights(self, replica: ReplicaHandle, version: int, weights: Any) -> None:
        local: _LocalReplica = replica.ref
        async with local.lock:
            local.runtime.load_weights(version, weights.value)

    # one process: get_weights hands over a broadcast's snapshot itself, so none is served
    async def serve_weights(self, rank: ReplicaHandle, world: int, backend: str, timeout_s: float) -> Group:
        raise FlowError("internal: an in-process engine sends weights by value, not by broadcast")

    async def send_weights(self, rank: ReplicaHandle, group: Group, snapshot: int, keep: list[str]) -> None:
        raise FlowError("internal: an in-process engine sends weights by value, not by broadcast")

    async def close(self) -> None:
        self._replicas.clear()
