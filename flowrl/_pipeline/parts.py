"""What the components of one pipeline share, handed to each when it is built.

``Parts`` holds the flow, its settings and the backend, and the state that several components
read or move: the samples in flight (``Ledger``), the pools and the window, the replicas
serving (``Roster``), the stats and the timeline, the task group (``Supervisor``), and how a
replica added later joins (``Joining``). A component takes ``Parts`` and, besides, only the
components it calls.

Two requests run against the order in which the components are built; each goes through a
queue instead of a callback set afterwards:

- a slot whose call hung asks for a replica in place of the one stopped (``Replacements``,
  served by ``Resizer``);
- samples dropped once their retries are spent are returned by ``Recovery`` to its caller,
  who ends them in their run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from .._backends.specs import default_spec

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


class Replacements:
    """Models that need a replica started in place of one stopped, in the order asked."""

    def __init__(self, pools: Mapping[str, AsyncPool]) -> None:
        self._pools = pools
        self._send, self.requests = anyio.create_memory_object_stream[str](math.inf)  # Resizer reads them

    def ask(self, model: str) -> None:
        """Ask for one replica of ``model``. Counted at once: until it serves, the pool does not
        count as dead when its last other replica dies."""
        self._pools[model].replacing += 1
        self._send.send_nowait(model)


@dataclass(frozen=True, kw_only=True)
class Joining:
    """How a replica added to a running pool joins it, fixed when the pipeline is built.

    ``spec`` places it (an engine: in its placement group). ``lock`` is held while the members
    change; an engine's weight sync holds it too, so that a sync sees a joining replica either
    before or after. ``prepare`` is awaited for the replica under the lock, before it serves (an
    engine sends it the current weights); if it fails, the replica is stopped."""

    spec: Callable[[Model, int], ReplicaSpec] = default_spec
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
