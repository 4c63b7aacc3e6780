"""The backend protocol, split by role (as anyio's ``abc`` is): a cluster of replica actors,
an object store, shard calls, and trainer groups. ``Backend`` is all four; the runtime and the
engine type their collaborators by the role they use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .._core.flow.batch import Batch
    from .._core.settings.config import CallMeta, ShardCall
    from .specs import ActorCounts, ReplicaHandle, ReplicaSpec
    from .weight_share import Group


class Cluster(Protocol):
    """Replica actors on a cluster: start, watch and stop them. ``counts``: the actors started
    so far and the train calls running (what the live view shows)."""

    counts: ActorCounts

    async def prepare(self, specs: list[ReplicaSpec]) -> None:
        """Connect to (or start) the cluster that will host all of ``specs``; check it can."""
        ...

    async def start(self, specs: list[ReplicaSpec]) -> list[ReplicaHandle]:
        """Start every replica (concurrently) and run ``setup`` in each."""
        ...

    async def alive(self, handle: ReplicaHandle) -> bool:
        """Whether the actor behind ``handle`` still runs (a trainer rank, after its group failed)."""
        ...

    async def stop(self, handles: list[ReplicaHandle]) -> None:
        """Stop these actors (a trainer group being rebuilt, replicas removed); returns once they are gone."""
        ...

    async def free(self) -> dict[str, float]:
        """The cluster's free resources now, by Ray's names (``CPU``, ``GPU``)."""
        ...

    def dead_nodes(self) -> set[str]:
        """Ids of the cluster's nodes that are gone."""
        ...

    def export_metrics(self, values: list[tuple[str, str, dict[str, str], float]]) -> None:
        """Gauges (name, description, tags, value) for the cluster's metrics (Prometheus)."""
        ...

    async def close(self) -> None:
        """Stop every replica; returns once they are gone."""
        ...


class ObjectStore(Protocol):
    """Where payloads live between stages: the driver's inputs, outputs, weights."""

    def put(self, batch: Batch) -> Any:
        """Store the driver's input batch; returns a reference replicas can fetch."""
        ...

    async def fetch(self, refs: list[Any]) -> list[Batch]: ...

    def share(self, value: Any) -> Any:
        """``value`` put where every replica can read it (weights to load); a reference."""
        ...

    async def value(self, ref: Any) -> Any:
        """The value behind a reference from ``get_weights``, on the driver."""
        ...

    def stored(self, ref: Any) -> bool:
        """Whether ``ref``'s data lives in a node's object store (it goes if the node goes)."""
        ...


class Shards(Protocol):
    """A replica runs a shard of a stage."""

    async def call(self, replica: ReplicaHandle, call: ShardCall) -> tuple[CallMeta, Any]:
        """Run one shard; returns the call's metadata and a reference to its new fields."""
        ...


class TrainerGroups(Protocol):
    """Data-parallel trainer groups: train steps, weights out and in, checkpoints."""

    async def start_trainer(self, specs: list[ReplicaSpec], timeout_s: float) -> list[ReplicaHandle]:
        """Start the ranks of one data-parallel trainer group, joined in a process group."""
        ...

    async def train(
        self, rank: ReplicaHandle, shard: Any, ids: list[int], step_size: int, micro_batch: int, iteration: int
    ) -> dict[str, Any]:
        """One train step on one rank; ``shard`` is a reference from ``put`` holding samples ``ids``."""
        ...

    async def get_weights(self, rank: ReplicaHandle) -> Any:
        """A reference to a trainer rank's (or a replica's) weights, left in the object store."""
        ...

    async def load_weights(self, replica: ReplicaHandle, version: int, weights: Any) -> None: ...

    async def serve_weights(self, rank: ReplicaHandle, world: int, backend: str, timeout_s: float) -> Group:
        """A new weight-broadcast group of ``world`` ranks, served by trainer ``rank`` (rank 0)."""
        ...

    async def send_weights(self, rank: ReplicaHandle, group: Group, snapshot: int, keep: list[str]) -> None:
        """Trainer ``rank`` broadcasts its weight ``snapshot`` to ``group``, keeping open only the
        groups ``keep`` names besides it."""
        ...

    async def save_state(self, rank: ReplicaHandle, alone: bool = False) -> tuple[bytes | None, bytes]:
        """A trainer rank's checkpoint: (its model's state, rank 0 only; its random generators).
        ``alone``: a survivor's own state after a peer died, or None if it may have changed
        (``TrainerRuntime.save_state``)."""
        ...

    async def load_state(self, rank: ReplicaHandle, model: bytes, rng: bytes | None) -> None: ...


class Backend(Cluster, ObjectStore, Shards, TrainerGroups, Protocol):
    """Everything a pipeline and an engine ask of a backend."""
