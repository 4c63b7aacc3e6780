"""What a backend is asked to start (``ReplicaSpec``, ``Bundle``), the handle it gives back
(``ReplicaHandle``), what it has started so far (``ActorCounts``), the capacity check shared by
the backends, and the debugging switch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._core.errors import ClusterError

if TYPE_CHECKING:
    from .._core.flow.model import Model


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


class ActorCounts:
    """What a backend has started and what its trainer ranks do now, for the live view: actors
    expected and ready per model, placement groups needed and reserved, train calls running
    per trainer. The backend counts; the engine says what to expect (it knows every pool)."""

    def __init__(self) -> None:
        self.expected: dict[str, int] = {}
        self.ready: dict[str, int] = {}
        self.groups: set[str] = set()
        self.reserved: set[str] = set()
        self.training: dict[str, int] = {}

    def expect(self, specs: list[ReplicaSpec]) -> None:
        for s in specs:
            self.expected[s.model.name] = self.expected.get(s.model.name, 0) + 1
            self.ready.setdefault(s.model.name, 0)
            if s.bundle is not None:
                self.groups.add(s.bundle.group)

    def started(self, model: str) -> None:
        self.ready[model] = self.ready.get(model, 0) + 1

    def training_started(self, model: str) -> None:
        self.training[model] = self.training.get(model, 0) + 1

    def training_ended(self, model: str) -> None:
        self.training[model] -= 1


def default_spec(model: Model, replica: int) -> ReplicaSpec:
    """A replica placed by its resources alone (no placement group)."""
    return ReplicaSpec(model, replica, model.config.cpus_per_replica, model.config.replica_gpus)


def _asks(specs: list[ReplicaSpec]) -> dict[str, dict[str, float]]:
    """Per resource, what each model (its replicas placed by their resources) or placement group
    (every bundle, reserved whole however little of it its replicas use) asks of the cluster."""
    asks: dict[str, dict[str, float]] = {"CPU": {}, "GPU": {}}
    groups: dict[str, tuple[Bundle, dict[str, None]]] = {}  # its bundle shape, its models in order
    for s in specs:
        if s.bundle is not None:
            groups.setdefault(s.bundle.group, (s.bundle, {}))[1][s.model.name] = None
            continue
        for resource, amount in (("CPU", s.num_cpus), ("GPU", s.num_gpus)):
            asks[resource][s.model.name] = asks[resource].get(s.model.name, 0.0) + amount
    for name, (bundle, models) in groups.items():
        who = f"placement group {name} of {', '.join(models)}"
        asks["CPU"][who], asks["GPU"][who] = bundle.size * bundle.cpus, bundle.size * bundle.gpus
    return asks


def check_capacity(specs: list[ReplicaSpec], total: dict[str, float], nodes: list[dict[str, float]]) -> None:
    """The replicas fit the cluster (``total`` resources) and each replica, or its placement
    bundle, fits one of ``nodes``; else Ray would wait for room until setup_timeout_s."""
    for resource, asked in _asks(specs).items():
        amount, have = sum(asked.values()), total.get(resource, 0.0)
        if amount > have + 1e-9:
            detail = ", ".join(f"{m}: {v:g}" for m, v in asked.items())
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
        what = (
            f"{cpus:g} CPU and {gpus:g} GPU"
            if s.bundle is None
            else f"a placement bundle of {cpus:g} CPU and {gpus:g} GPU"
        )
        raise ClusterError(
            f"a replica of model {s.model.name!r} needs {what} on one node, but the largest node has "
            f"{largest.get('CPU', 0.0):g} CPU and {largest.get('GPU', 0.0):g} GPU; lower ModelConfig.gpus_per_replica "
            "(or tensor_parallel_size) or cpus_per_replica, or add a bigger node"
        )


DEBUG_ENV = "FLOWRL_DEBUG"


def debugging() -> bool:
    """``FLOWRL_DEBUG=1``: every pipeline and engine runs in this process, whatever its config,
    so ``breakpoint()`` in a step stops there (the in-process backend, one replica at a time)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
