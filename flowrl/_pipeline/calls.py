"""A shard call to a replica, within its model's ``call_timeout_s``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from .._core.errors import StageError

if TYPE_CHECKING:
    from .._backends.abc import Shards
    from .._backends.specs import ReplicaHandle
    from .._core.config import CallMeta, ShardCall
    from .._core.graph import FlowGraph


class ShardCaller:
    def __init__(self, graph: FlowGraph, backend: Shards) -> None:
        self._graph = graph
        self._backend = backend

    async def __call__(self, handle: ReplicaHandle, call: ShardCall) -> tuple[CallMeta, Any]:
        deadline = self._graph.models[handle.model].config.call_timeout_s
        if deadline is None:
            return await self._backend.call(handle, call)
        with anyio.move_on_after(deadline):
            return await self._backend.call(handle, call)
        raise StageError(
            f"no reply within ModelConfig.call_timeout_s={deadline:g}s (the step hangs, or takes longer than that)",
            call.stage,
            handle.replica_id,
            call.ids,
        )
