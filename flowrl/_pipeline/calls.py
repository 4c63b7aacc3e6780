"""A shard call to a replica, within its model's ``call_timeout_s``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from .._core.errors import ReplicaDiedError, StageError

if TYPE_CHECKING:
    from .._backends.abc import Cluster, Shards
    from .._backends.specs import ReplicaHandle
    from .._core.settings.config import CallMeta, ShardCall
    from .parts import Parts


class Hung(ReplicaDiedError):
    """A call got no reply within ``call_timeout_s`` and its replica was stopped
    (``on_timeout="retry"``): its samples go to another replica, and a new one replaces it."""


class ShardCaller:
    def __init__(self, parts: Parts) -> None:
        self._graph = parts.graph
        self._backend: Shards = parts.backend
        self._cluster: Cluster = parts.backend

    async def __call__(self, handle: ReplicaHandle, call: ShardCall, ahead: int = 0) -> tuple[CallMeta, Any]:
        """``ahead``: the shards in flight on the replica before this one, which it waits behind
        (each gets its own ``call_timeout_s``)."""
        config = self._graph.models[handle.model].config
        deadline = config.call_timeout_s
        if deadline is None:
            return await self._backend.call(handle, call)
        with anyio.move_on_after(deadline * (1 + ahead)):
            return await self._backend.call(handle, call)
        if config.on_timeout == "retry":
            with anyio.CancelScope(shield=True):
                await self._cluster.stop([handle])  # it may hang for good: it serves no more
            raise Hung(
                f"no reply within ModelConfig.call_timeout_s={deadline:g}s; the replica was stopped and its "
                "samples go to another replica (on_timeout='retry')",
                call.stage,
                handle.replica_id,
                call.ids,
            )
        raise StageError(
            f"no reply within ModelConfig.call_timeout_s={deadline:g}s (the step hangs, or takes longer than that)",
            call.stage,
            handle.replica_id,
            call.ids,
        )
