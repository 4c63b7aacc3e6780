"""Parts of the RL engine (layer 6): its statistics, placement of replicas, the running set."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from .._backends.select import make_backend
from .._backends.specs import Bundle, ReplicaHandle, ReplicaSpec, default_spec
from .._core.batch import Sample
from .._core.errors import ConfigError, FlowDefinitionError
from .._core.model import Model
from .._core.stats import PipelineStats
from .._pipeline.opening import Flow, build_flow, plain_errors, running

if TYPE_CHECKING:
    from .._backends.abc import Backend
    from .._core.graph import FlowGraph
    from .._core.run_config import RunConfig
    from .._pipeline.pipeline import AsyncPipeline


class RankStats(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    samples: int
    steps: int
    busy_s: float


class TrainerStats(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    samples: int
    steps: int
    ranks: list[RankStats]


class EpisodeStats(msgspec.Struct, frozen=True, kw_only=True):
    """One episode: its phases' seconds, mean train metrics per trainer, weight versions after it.

    ``staleness``: per synced inference model, how many weight versions behind the one its
    replicas held at training time each trained sample was generated (versions -> samples;
    above 0 for samples a relay function brings back from earlier episodes, and with
    ``max_staleness`` > 0). ``wait_s``: how long training waited for this episode's rollout
    (all of ``rollout_s`` when synchronous). ``dropped`` / ``regenerated``: samples over the
    staleness bound (``on_stale``).
    """

    episode: int
    samples: int
    rollout_s: float
    train_s: float
    sync_s: float
    eval_s: float
    metrics: dict[str, dict[str, float]]
    weight_versions: dict[str, int]
    staleness: dict[str, dict[int, int]] = {}
    wait_s: float = 0.0
    dropped: int = 0
    regenerated: int = 0


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    rollout: PipelineStats | None
    evaluation: PipelineStats | None
    trainers: dict[str, TrainerStats]
    episodes: list[EpisodeStats]


def trainer_models(train: Sequence[Model] | Flow) -> list[Model]:
    if callable(train) and not isinstance(train, Model):
        graph = build_flow(train)
        bad = [s.name for s in graph.stages.values() if s.method != "train_step"]
        if bad:
            raise FlowDefinitionError(f"a train flow calls train_step only; it calls {bad}")
        return list(dict.fromkeys(graph.models[s.model] for s in graph.stages.values()))
    models = list(train)
    for m in models:
        if not isinstance(m, Model) or getattr(type(m), "train_step", None) is None:
            raise FlowDefinitionError(f"train: expected models that define train_step, got {m!r}")
    return models


def mean_metrics(steps: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Numeric metrics averaged over steps and ranks, each rank weighted by its samples."""
    sums: dict[str, list[float]] = {}
    for step in steps:
        for rank in step:
            weight = rank.pop("_samples", 1)
            for k, v in rank.items():
                if weight and not k.startswith("_") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    acc = sums.setdefault(k, [0.0, 0.0])
                    acc[0] += float(v) * weight
                    acc[1] += weight
    return {k: total / count for k, (total, count) in sums.items() if count}


def relayed(fn: Callable[[list[Any]], Any], episodes: list[Any]) -> list[Sample]:
    """The relay function's training samples, checked: a list of samples, not empty."""
    name = getattr(fn, "__name__", "the relay function")
    out = fn(episodes)
    if out is None or isinstance(out, (Mapping, str, bytes)) or not hasattr(out, "__iter__"):
        raise FlowDefinitionError(
            f"relay function {name} returned {type(out).__name__}; it must return the samples to train on "
            "(a list of flowrl.Sample, e.g. drawn from its episodes' .samples)"
        )
    out = list(out)
    if not out:
        raise FlowDefinitionError(f"relay function {name} returned no samples; it must return at least one to train on")
    bad = next((x for x in out if not isinstance(x, Sample)), None)
    if bad is not None:
        raise FlowDefinitionError(
            f"relay function {name} returned a {type(bad).__name__} among its samples; every item must be a "
            "flowrl.Sample (from its episodes' .samples)"
        )
    return out


class Placement:
    """Where each replica goes. GPU replicas are placed through placement groups: a colocation
    group's (one GPU per bundle, shared by the group's models through fractional GPUs) or
    their own pool's (one bundle per replica)."""

    def __init__(self, config: RunConfig, models: Mapping[str, Model]) -> None:
        self.groups = config.colocation
        self.models = models
        for gi, group in enumerate(self.groups):
            size = self._size(group)
            for name in group:
                c = models[name].config
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
        """The spec of ``model``'s replica; ``pool`` keeps a second pool (evaluation) apart."""
        c = model.config
        if c.replica_gpus <= 0:
            return ReplicaSpec(model, replica, c.cpus_per_replica, 0.0)
        for gi, group in enumerate(self.groups):
            if model.name in group:
                size = self._size(group)
                configs = [self.models[n].config for n in group]
                cpus = round(sum(x.cpus_per_replica * math.ceil(x.replicas / size) for x in configs), 4)
                bundle = Bundle(f"colocate-{gi}{pool}", replica % size, size, cpus)
                share = math.floor(c.replica_gpus / len(group) * 10_000) / 10_000  # Ray counts 1e-4 steps
                return ReplicaSpec(model, replica, c.cpus_per_replica, share, bundle)
        bundle = Bundle(f"model-{model.name}{pool}", replica, c.replicas, c.cpus_per_replica, c.replica_gpus)
        return ReplicaSpec(model, replica, c.cpus_per_replica, c.replica_gpus, bundle)

    def grown(self, model: Model, replica: int) -> ReplicaSpec:
        """The spec of a replica added while the engine runs: placed by its resources alone."""
        if any(model.name in group for group in self.groups):
            raise ConfigError(
                f"model {model.name!r} is colocated (RunConfig.colocation): its replicas share GPUs with other "
                "models', so its pool cannot grow or shrink; leave it out of colocation to resize it"
            )
        return default_spec(model, replica)


class Live:
    """The running parts of an engine: backend, trainer groups, rollout and eval pipelines."""

    def __init__(
        self,
        config: RunConfig,
        placement: Placement,
        trainers: list[Model],
        rollout: FlowGraph,
        evaluation: FlowGraph | None,
    ) -> None:
        self.config = config
        self.placement = placement
        self.backend: Backend = make_backend(config.pipeline)
        self.stack = contextlib.AsyncExitStack()
        self.trainer_models = trainers
        self.graphs = (rollout, evaluation)
        self.trainers: dict[str, list[ReplicaHandle]] = {}
        self.rollout: AsyncPipeline | None = None
        self.evaluation: AsyncPipeline | None = None
        self.last_stats: tuple[PipelineStats | None, PipelineStats | None] = (None, None)
        self.members = anyio.Lock()

    def replicas_of(self, model: str) -> list[ReplicaHandle]:
        """Every replica of ``model``, in the rollout and the evaluation pools."""
        return [h for pipe in (self.rollout, self.evaluation) if pipe is not None for h in pipe.replicas_of(model)]

    async def start(self) -> None:
        try:
            async with plain_errors():
                await self._start_parts()
        except BaseException:
            await self.stop()
            raise

    def _pool_specs(self, graph: FlowGraph | None, pool: str) -> list[ReplicaSpec]:
        if graph is None:
            return []
        return [self.placement.spec(m, r, pool) for m in graph.models.values() for r in range(m.config.replicas)]

    async def _start_parts(self) -> None:
        rollout, evaluation = self.graphs
        trainer_specs = {
            m.name: [self.placement.spec(m, r) for r in range(m.config.replicas)] for m in self.trainer_models
        }
        everything = [s for specs in trainer_specs.values() for s in specs]
        everything += self._pool_specs(rollout, "") + self._pool_specs(evaluation, "-eval")
        await self.backend.prepare(everything)  # an embedded cluster is sized for all pools
        cfg = msgspec.structs.replace(self.config.pipeline, progress="off")  # the engine's own view covers them
        for model in self.trainer_models:
            await self.start_trainer(model)
        self.rollout = await self.stack.enter_async_context(running(rollout, self.backend, cfg, self.placement.spec))
        if evaluation is not None:
            self.evaluation = await self.stack.enter_async_context(
                running(evaluation, self.backend, cfg, lambda m, r: self.placement.spec(m, r, "-eval"))
            )
        for pipe in (self.rollout, self.evaluation):
            if pipe is not None:  # one lock: a weight sync and a pool's change of members exclude each other
                pipe.members_lock, pipe.grow_spec = self.members, self.placement.grown

    async def start_trainer(self, model: Model) -> None:
        specs = [self.placement.spec(model, r) for r in range(model.config.replicas)]
        self.trainers[model.name] = await self.backend.start_trainer(specs, timeout_s=self.config.collective_timeout_s)

    async def restart_trainer(self, name: str) -> None:
        """Stop every rank of trainer ``name`` (some may wait in a collective) and start new ones."""
        await self.backend.stop(self.trainers.pop(name))
        await self.start_trainer(next(m for m in self.trainer_models if m.name == name))

    def stats(self) -> tuple[PipelineStats | None, PipelineStats | None]:
        live = tuple(p.stats() if p is not None else None for p in (self.rollout, self.evaluation))
        return live if self.rollout is not None else self.last_stats  # type: ignore[return-value]

    async def stop(self) -> None:
        self.last_stats = self.stats()
        try:
            async with plain_errors():
                await self.stack.aclose()
        finally:
            self.rollout = self.evaluation = None
            with anyio.CancelScope(shield=True):
                await self.backend.close()
