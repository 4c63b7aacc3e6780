"""What the components of one pipeline share, handed to each when it is built.

``Parts`` holds the flow, its settings and the backend, and the state that several components
read or move: the samples in flight (``Ledger``), the pools and the window, the replicas
serving (``Roster``), the stats and the timeline, the task group (``Supervisor``), and how a
replica added later joins (``Joining``). A component takes ``Parts`` and, besides, only the
components it calls.

Two requests run against the order in which the components are built; each goes through a
queue instead of a callback set afterwards:

- a replica that died or hung asks for one in its place (``Replacements``, which asks the
  pool's ``RestartPolicy``, served by ``Resizer``);
- samples dropped once their retries are spent are returned by ``Recovery`` to its caller,
  who ends them in their run.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from .._backends.specs import default_spec
from .._core.scheduling.restarts import RestartPolicy

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from .._backends.abc import Backend
    from .._backends.specs import ReplicaHandle, ReplicaSpec
    from .._core.flow.graph import FlowGraph
    from .._core.flow.model import Model
    from .._core.observe.pipeline_stats import StatsRecorder
    from .._core.observe.trace import Timeline
    from .._core.settings.config import PipelineConfig
    from .ledger import Ledger
    from .pools import AsyncPool, Window
    from .roster import Roster
    from .supervisor import Supervisor


@dataclass(frozen=True)
class Replacement:
    """A replica stopped (``old``): start one in its place after ``delay_s``, or, with
    ``delay_s`` None, report that none is started (``reason`` says why)."""

    model: str
    old: int
    delay_s: float | None
    reason: str
    noticed: float = field(default_factory=time.time)  # when ``old`` was stopped (kept over a failed start)


class Replacements:
    """Replicas to start in place of those stopped, in the order asked; the pools' policies."""

    def __init__(self, pools: Mapping[str, AsyncPool], graph: FlowGraph) -> None:
        self._pools = pools
        self.policies = {name: RestartPolicy(name, m.config.healing) for name, m in graph.models.items()}
        self._send, self.requests = anyio.create_memory_object_stream[Replacement](math.inf)  # Resizer reads them
        self._idle = anyio.Event()
        self._idle.set()

    def hung(self, handle: ReplicaHandle) -> None:
        """``handle`` was stopped because a call hung (``on_timeout="retry"``): always replaced."""
        self._ask(Replacement(handle.model, handle.replica_id, 0.0, "replaced a replica whose call hung"))

    def died(self, handle: ReplicaHandle) -> None:
        """``handle``'s process died: replaced as its pool's ``Healing`` says, or reported."""
        answer = self.policies[handle.model].died(handle.replica_id, time.monotonic())
        request = Replacement(handle.model, handle.replica_id, answer.delay_s, answer.reason)
        if answer.delay_s is None:
            self._send.send_nowait(request)
        else:
            self._ask(request)

    def start_failed(self, request: Replacement, why: str) -> str | None:
        """``request``'s replica could not start: asked again as the pool's policy says (None),
        or the reason none is."""
        answer = self.policies[request.model].start_failed(request.old, time.monotonic())
        if answer.delay_s is None:
            return answer.reason
        reason = f"{answer.reason}; the last start: {why}"
        self._ask(Replacement(request.model, request.old, answer.delay_s, reason, request.noticed))
        return None

    def served(self, model: str, replica: int) -> None:
        self.policies[model].served(replica)

    def _ask(self, request: Replacement) -> None:
        """Counted at once: until the new replica serves, the pool does not count as dead when
        its last other replica dies."""
        if self._idle.is_set():
            self._idle = anyio.Event()
        self._pools[request.model].replacing += 1
        self._send.send_nowait(request)

    def finished(self, model: str) -> None:
        """A replacement of ``model`` serves now, or will not."""
        self._pools[model].replacing -= 1
        if not any(pool.replacing for pool in self._pools.values()):
            self._idle.set()

    async def settled(self) -> None:
        """Returns once no replacement is starting (at once if none is)."""
        while not self._idle.is_set():
            await self._idle.wait()


def by_resources(model: Model, replica: int, replaces: int | None) -> ReplicaSpec:
    """A replica added to a running pool, placed by its resources alone."""
    return default_spec(model, replica)


@dataclass(frozen=True, kw_only=True)
class Joining:
    """How a replica added to a running pool joins it, fixed when the pipeline is built.

    ``spec(model, replica, replaces)`` places it: ``replaces`` is the replica it takes the place
    of (one that died or hung), None for a grow; an engine puts a replacement in the placement
    bundle the replica it replaces held. ``lock`` is held while the members change; an engine's
    weight sync holds it too, so that a sync sees a joining replica either before or after.
    ``prepare`` is awaited for the replica under the lock, before it serves (an engine sends it
    the current weights); if it fails, the replica is stopped."""

    spec: Callable[[Model, int, int | None], ReplicaSpec] = by_resources
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    prepare: Callable[[ReplicaHandle], Awaitable[None]] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Parts:
    graph: FlowGraph
    config: PipelineConfig
    backend: Backend
    ledger: Ledger
    pools: Mapping[str, AsyncPool]
    window: Window
    roster: Roster
    recorder: StatsRecorder
    timeline: Timeline
    supervisor: Supervisor
    replacements: Replacements
    joining: Joining
