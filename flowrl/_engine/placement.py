"""Where an engine's replicas go: placement groups for GPU replicas, colocation."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .._backends.specs import Bundle, ReplicaSpec, default_spec
from .._core.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping

    from .._core.flow.model import Model
    from .._core.settings.run_config import RunConfig


class Placement:
    """Where each replica goes. GPU replicas are placed through placement groups: a colocation
    group's (one GPU per bundle, shared by the group's models through fractional GPUs) or
    their own pool's (one bundle per replica). ``evaluated``: the models that also have an
    evaluation pool; a colocated one's evaluation replicas share the group's GPUs too (a group
    of their own would need as many GPUs again, and wait for them forever on a full machine)."""

    def __init__(self, config: RunConfig, models: Mapping[str, Model], evaluated: Collection[str] = ()) -> None:
        self.groups = config.colocation
        self.models = models
        self.evaluated = frozenset(evaluated)
        # (model, pool, replica added while running) -> the bundle it took (None: placed by resources)
        self._slots: dict[tuple[str, str, int], int | None] = {}
        for gi, group in enumerate(self.groups):
            for name in group:
                self._check_colocated(gi, group, models[name])

    def _check_colocated(self, gi: int, group: list[str], model: Model) -> None:
        c, size, name = model.config, self._size(group), model.name
        if c.autoscale is not None:
            raise ConfigError(
                f"colocation group {gi}: model {name!r} has ModelConfig.autoscale, but colocated replicas "
                "share GPUs with other models' and their pools cannot grow or shrink"
            )
        if c.replica_gpus > 1:
            raise ConfigError(
                f"colocation: model {name!r} has replicas of {c.replica_gpus:g} GPUs; colocated replicas "
                "hold at most one GPU each for now (set gpus_per_replica <= 1, or leave it out)"
            )
        if math.ceil(c.replicas / size) * c.replica_gpus > 1 + 1e-9:
            raise ConfigError(
                f"colocation group {gi}: model {name!r} puts {math.ceil(c.replicas / size)} replicas of "
                f"{c.replica_gpus:g} GPU on each of the group's {size} GPUs; give it at most {size} replicas"
            )

    def _size(self, group: list[str]) -> int:
        return max(
            1, max(math.ceil(self.models[n].config.replicas * self.models[n].config.replica_gpus) for n in group)
        )

    def spec(self, model: Model, replica: int, pool: str = "") -> ReplicaSpec:
        """The spec of ``model``'s replica; ``pool`` gives a second pool (evaluation) placement groups
        of its own, except where ``model`` is colocated: its group's are shared by both pools."""
        c = model.config
        if c.replica_gpus <= 0:
            return ReplicaSpec(model, replica, c.cpus_per_replica, 0.0)
        for gi, group in enumerate(self.groups):
            if model.name in group:
                size = self._size(group)
                # the pools on each GPU of the group: its models' and their evaluation pools
                configs = [self.models[n].config for n in [*group, *(n for n in group if n in self.evaluated)]]
                cpus = round(sum(x.cpus_per_replica * math.ceil(x.replicas / size) for x in configs), 4)
                bundle = Bundle(f"colocate-{gi}", replica % size, size, cpus)
                share = math.floor(c.replica_gpus / len(configs) * 10_000) / 10_000  # Ray counts 1e-4 steps
                return ReplicaSpec(model, replica, c.cpus_per_replica, share, bundle)
        bundle = Bundle(f"model-{model.name}{pool}", replica, c.replicas, c.cpus_per_replica, c.replica_gpus)
        return ReplicaSpec(model, replica, c.cpus_per_replica, c.replica_gpus, bundle)

    def joined(self, model: Model, replica: int, replaces: int | None, pool: str = "") -> ReplicaSpec:
        """The spec of a replica added while the engine runs. One that takes the place of a replica
        that died or hung (``replaces``) goes into that replica's placement bundle, which its end
        freed: a GPU pool's placement group holds every GPU it was given, so a replacement placed
        by its resources alone would wait for a GPU outside it, and a colocated one has no other
        place. A grow is placed by its resources alone (``grown``), and so is its replacement."""
        slot = None if replaces is None else self._slots.get((model.name, pool, replaces), replaces)
        self._slots[(model.name, pool, replica)] = slot  # a replacement's own replacement: the same place
        if slot is None:
            return self.grown(model, replica)
        return dataclasses.replace(self.spec(model, slot, pool), replica_id=replica)

    def grown(self, model: Model, replica: int) -> ReplicaSpec:
        """The spec of a replica added while the engine runs: placed by its resources alone."""
        if any(model.name in group for group in self.groups):
            raise ConfigError(
                f"model {model.name!r} is colocated (RunConfig.colocation): its replicas share GPUs with other "
                "models', so its pool cannot grow or shrink; leave it out of colocation to resize it"
            )
        return default_spec(model, replica)
