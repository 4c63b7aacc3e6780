"""The in-process backend (layer 4): same semantics as Ray, one process, breakpoints work.

Each replica is a deep copy of the driver's model instance. Calls run inline on the event
loop (``threads=False``, the debugging mode: ``breakpoint()`` in a step just works) or in
worker threads so replicas overlap (``threads=True``). A replica runs one shard at a time.
"""

from __future__ import annotations

import copy
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from ._batch import Batch
from ._config import CallMeta, ShardCall
from ._replica import ReplicaRuntime
from ._backend import ReplicaHandle, ReplicaSpec


class LocalRef:
    """A stand-in for an object reference: holds the value itself."""

    __slots__ = ("value",)

    def __init__(self, value: Batch) -> None:
        self.value = value


def _fetch(refs: list[Any]) -> list[Batch]:
    return [r.value for r in refs]


class _LocalReplica:
    def __init__(self, runtime: ReplicaRuntime) -> None:
        self.runtime = runtime
        self.lock = anyio.Lock()


class InProcessBackend:
    def __init__(self, *, threads: bool = False) -> None:
        self.threads = threads
        self._replicas: list[_LocalReplica] = []

    async def start(self, specs: list[ReplicaSpec]) -> list[ReplicaHandle]:
        handles = []
        for spec in specs:
            runtime = ReplicaRuntime(copy.deepcopy(spec.model), spec.replica_id)
            runtime.setup(gpu_ids=[], node_id="local")
            replica = _LocalReplica(runtime)
            self._replicas.append(replica)
            handles.append(ReplicaHandle(spec.model.name, spec.replica_id, "local", replica))
        return handles

    def put(self, batch: Batch) -> LocalRef:
        return LocalRef(batch)

    async def call(self, replica: ReplicaHandle, call: ShardCall) -> tuple[CallMeta, Any]:
        local: _LocalReplica = replica.ref
        async with local.lock:
            if self.threads:
                meta, out = await anyio.to_thread.run_sync(local.runtime.run, call, _fetch, abandon_on_cancel=True)
            else:
                meta, out = local.runtime.run(call, _fetch)
                await anyio.lowlevel.checkpoint()
        return meta, LocalRef(out)

    async def fetch(self, refs: list[Any]) -> list[Batch]:
        return _fetch(refs)

    async def close(self) -> None:
        self._replicas.clear()
