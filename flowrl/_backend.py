"""The execution backend protocol (layer 4) and the choice between backends."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from ._batch import Batch
from ._config import CallMeta, PipelineConfig, ShardCall
from ._errors import ClusterError
from ._model import Model
from ._weight_share import Group


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


def default_spec(model: Model, replica: int) -> ReplicaSpec:
    """A replica placed by its resources alone (no placement group)."""
    return ReplicaSpec(model, replica, model.config.cpus_per_replica, model.config.replica_gpus)


def check_capacity(specs: list[ReplicaSpec], total: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """The replicas fit the cluster (``total`` resources) and each replica, or its placement
    bundle, fits one of ``nodes``; else Ray would wait for room until setup_timeout_s."""
    need = {"CPU": sum(s.num_cpus for s in specs), "GPU": sum(s.num_gpus for s in specs)}
    for resource, amount in need.items():
        have = total.get(resource, 0.0)
        if amount > have + 1e-9:
            per_model: dict[str, float] = {}
            for s in specs:
                per_model[s.model.name] = per_model.get(s.model.name, 0.0) + (s.num_cpus if resource == "CPU" else s.num_gpus)
            detail = ", ".join(f"{m}: {v:g}" for m, v in per_model.items())
            key = "cpus_per_replica" if resource == "CPU" else "gpus_per_replica / num_gpu"
            raise ClusterError(
                f"the pools need {amount:g} {resource} ({detail}) but the cluster has {have:g}; "
                f"lower ModelConfig.{key} or the replica counts, or add nodes"
            )
    for s in specs:
        cpus, gpus = (s.bundle.cpus, s.bundle.gpus) if s.bundle is not None else (s.num_cpus, s.num_gpus)
        if any(n.get("CPU", 0.0) + 1e-9 >= cpus and n.get("GPU", 0.0) + 1e-9 >= gpus for n in nodes):
            continue
        largest = max(nodes, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)), default={})
        what = f"{cpus:g} CPU and {gpus:g} GPU" if s.bundle is None else f"a placement bundle of {cpus:g} CPU and {gpus:g} GPU"
        raise ClusterError(
            f"a replica of model {s.model.name!r} needs {what} on one node, but the largest node has "
            f"{largest.get('CPU', 0.0):g} CPU and {largest.get('GPU', 0.0):g} GPU; lower ModelConfig.gpus_per_replica "
            "(or tensor_parallel_size) or cpus_per_replica, or add a bigger node"
        )


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
        """A reference to a trainer rank's (or a replica's) weights, left in the object store."""
        ...

    async def load_weights(self, replica: ReplicaHandle, version: int, weights: Any) -> None:
        ...

    async def serve_weights(self, rank: ReplicaHandle, world: int, backend: str, timeout_s: float) -> Group:
        """A new weight-broadcast group of ``world`` ranks, served by trainer ``rank`` (rank 0)."""
        ...

    async def send_weights(self, rank: ReplicaHandle, group: Group, snapshot: int, keep: list[str]) -> None:
        """Trainer ``rank`` broadcasts its weight ``snapshot`` to ``group``, keeping open only the
        groups ``keep`` names besides it."""
        ...

    async def save_state(self, rank: ReplicaHandle) -> tuple[bytes | None, bytes]:
        """A trainer rank's checkpoint: (its model's state, rank 0 only; its random generators)."""
        ...

    async def load_state(self, rank: ReplicaHandle, model: bytes, rng: bytes | None) -> None:
        ...

    async def value(self, ref: Any) -> Any:
        """The value behind a reference from ``get_weights``, on the driver."""
        ...

    def share(self, value: Any) -> Any:
        """``value`` put where every replica can read it (weights to load); a reference."""
        ...

    def stored(self, ref: Any) -> bool:
        """Whether ``ref``'s data lives in a node's object store (it goes if the node goes)."""
        ...

    def dead_nodes(self) -> set[str]:
        """Ids of the cluster's nodes that are gone."""
        ...

    def export_metrics(self, values: list[tuple[str, str, dict[str, str], float]]) -> None:
        """Gauges (name, description, tags, value) for the cluster's metrics (Prometheus)."""
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

    async def close(self) -> None:
        """Stop every replica; returns once they are gone."""
        ...


DEBUG_ENV = "FLOWRL_DEBUG"


def debugging() -> bool:
    """``FLOWRL_DEBUG=1``: every pipeline and engine runs in this process, whatever its config,
    so ``breakpoint()`` in a step stops there (the in-process backend, one replica at a time)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def make_backend(config: PipelineConfig) -> Backend:
    if config.backend == "inprocess" or debugging():
        from ._inprocess import InProcessBackend

        return InProcessBackend(threads=config.inprocess_threads and not debugging())
    from ._ray_backend import RayBackend

    return RayBackend(config)
