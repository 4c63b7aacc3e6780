"""The execution backend protocol (layer 4) and the choice between backends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ._batch import Batch
from ._config import CallMeta, PipelineConfig, ShardCall
from ._model import Model


@dataclass(frozen=True)
class Bundle:
    """Where a replica goes: bundle ``index`` of its group's placement group (a colocation
    group's, with one GPU per bundle shared by its models, or its own model's)."""

    group: str
    index: int
    size: int  # bundles in the group's placement group
    cpus: float  # CPUs of each bundle: room for every replica placed on it
    gpus: float = 1.0  # GPUs of each bundle


@dataclass(frozen=True)
class ReplicaSpec:
    model: Model
    replica_id: int
    num_cpus: float
    num_gpus: float
    bundle: Bundle | None = None


@dataclass(frozen=True)
class ReplicaHandle:
    model: str
    replica_id: int
    node_id: str
    ref: Any  # the backend's own handle


class Backend(Protocol):
    async def prepare(self, specs: list[ReplicaSpec]) -> None:
        """Connect to (or start) the cluster that will host all of ``specs``; check it can."""
        ...

    async def start(self, specs: list[ReplicaSpec]) -> list[ReplicaHandle]:
        """Start every replica (concurrently) and run ``setup`` in each."""
        ...

    def put(self, batch: Batch) -> Any:
        """Store the driver's input batch; returns a reference replicas can fetch."""
        ...

    async def call(self, replica: ReplicaHandle, call: ShardCall) -> tuple[CallMeta, Any]:
        """Run one shard; returns the call's metadata and a reference to its new fields."""
        ...

    async def fetch(self, refs: list[Any]) -> list[Batch]:
        ...

    async def start_trainer(self, specs: list[ReplicaSpec], timeout_s: float) -> list[ReplicaHandle]:
        """Start the ranks of one data-parallel trainer group, joined in a process group."""
        ...

    async def train(
        self, rank: ReplicaHandle, shard: Any, ids: list[int], step_size: int, micro_batch: int, iteration: int
    ) -> dict[str, Any]:
        """One train step on one rank; ``shard`` is a reference from ``put`` holding samples ``ids``."""
        ...

    async def get_weights(self, rank: ReplicaHandle) -> Any:
        """A reference to the trainer's weights, left in the object store."""
        ...

    async def load_weights(self, replica: ReplicaHandle, version: int, weights: Any) -> None:
        ...

    async def close(self) -> None:
        """Stop every replica; returns once they are gone."""
        ...


def make_backend(config: PipelineConfig) -> Backend:
    if config.backend == "inprocess":
        from ._inprocess import InProcessBackend

        return InProcessBackend(threads=config.inprocess_threads)
    from ._ray_backend import RayBackend

    return RayBackend(config)
