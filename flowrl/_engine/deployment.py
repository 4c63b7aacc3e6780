"""What an engine has started: the backend, the trainer groups, the rollout and
evaluation pipelines; from ``deploy`` to ``Deployment.stop``."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import anyio
import msgspec

from .._backends.select import make_backend
from .._core.flow.streams import derived_seed
from .._core.observe.pipeline_stats import PipelineStats
from .._pipeline.opening import plain_errors, running
from .._pipeline.parts import Joining
from .._pipeline.progress import showing_startup

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._backends.abc import Backend
    from .._backends.specs import ReplicaHandle, ReplicaSpec
    from .._core.errors import ReplicaDiedError
    from .._core.flow.graph import FlowGraph
    from .._core.flow.model import Model
    from .._core.scheduling.autoscale import ScaleEvent
    from .._core.settings.run_config import RunConfig
    from .._pipeline.pipeline import AsyncPipeline
    from .placement import Placement

# the rollout pipeline's stats, the evaluation one's
PipelineStatsPair = tuple[PipelineStats | None, PipelineStats | None]


class Deployment:
    """The engine's models at work on a backend: trainer groups (rank handles by trainer name),
    the rollout pipeline and the evaluation one (if any). ``members`` is one lock for all the
    pools: a weight sync and a pool's change of members exclude each other."""

    def __init__(
        self,
        config: RunConfig,
        placement: Placement,
        backend: Backend,
        stack: contextlib.AsyncExitStack,
        trainers: dict[str, list[ReplicaHandle]],
        pools: tuple[AsyncPipeline, AsyncPipeline | None],
        members: anyio.Lock,
    ) -> None:
        self.config = config
        self.placement = placement
        self.backend = backend
        self.trainers = trainers
        self.rollout, self.evaluation = pools
        self.members = members
        self._stack = stack
        self._stopped: PipelineStatsPair | None = None  # the pipelines' last stats, once stopped
        self._replaced: list[ScaleEvent] | None = None  # and their replacements

    @property
    def running(self) -> bool:
        return self._stopped is None

    def pipelines(self) -> list[AsyncPipeline]:
        return [self.rollout] if self.evaluation is None else [self.rollout, self.evaluation]

    def replicas_of(self, model: str) -> list[ReplicaHandle]:
        """Every replica of ``model``, in the rollout and the evaluation pools."""
        return [h for pipe in self.pipelines() for h in pipe.replicas_of(model)]

    def retire(self, handle: ReplicaHandle, err: ReplicaDiedError) -> None:
        """``handle`` died loading weights: the pool it belongs to (rollout or evaluation)
        carries on without it; ReplicaDiedError if it was the last replica of that pool."""
        for pipe in self.pipelines():
            if pipe.retire(handle, err):
                return

    async def restart_trainer(self, model: Model) -> None:
        """Stop every rank of trainer ``model`` (some may wait in a collective) and start new ones."""
        await self.backend.stop(self.trainers[model.name])
        self.trainers[model.name] = []  # none until the new ones have started (a rank may die in setup)
        self.trainers[model.name] = await _start_trainer(self.backend, self.config, self.placement, model)

    def trainer_rows(self, trained: dict[str, int]) -> dict[str, tuple[int, int, int]]:
        """Per trainer: ranks in a train step now, ranks, and ``trained[name]`` (samples so far)."""
        busy = self.backend.counts.training
        return {name: (busy.get(name, 0), len(ranks), trained.get(name, 0)) for name, ranks in self.trainers.items()}

    def stats(self) -> PipelineStatsPair:
        if self._stopped is not None:
            return self._stopped
        return self.rollout.stats(), self.evaluation.stats() if self.evaluation is not None else None

    def replaced(self) -> list[ScaleEvent]:
        """The rollout's replacements of replicas that died or hung, with their recovery times."""
        if self._replaced is not None:
            return self._replaced
        return [e for e in self.rollout.scale_events if e.recovery_s is not None]

    async def stop(self) -> None:
        self._stopped, self._replaced = self.stats(), self.replaced()
        await _close(self._stack, self.backend)


async def deploy(
    config: RunConfig,
    placement: Placement,
    trainers: list[Model],
    graphs: tuple[FlowGraph, FlowGraph | None],
    prepare: Callable[[ReplicaHandle], Awaitable[None]],
) -> Deployment:
    """Start the trainer groups and the pipelines (rollout, evaluation); on a failure, stop what
    started. ``prepare`` readies a replica that joins a pool later (hands it the weights)."""
    # RunConfig.reproducibility.deterministic reaches the backend (its replicas and trainer ranks run torch's
    # deterministic algorithms) and the pipelines (fixed shards)
    deterministic = config.reproducibility.deterministic or config.pipeline.deterministic
    backend = make_backend(msgspec.structs.replace(config.pipeline, deterministic=deterministic))
    stack = contextlib.AsyncExitStack()
    try:
        async with plain_errors():
            specs = [placement.spec(m, r) for m in trainers for r in range(m.config.replicas)]
            specs += _pool_specs(placement, graphs[0], "") + _pool_specs(placement, graphs[1], "-eval")
            backend.counts.expect(specs)
            joining = Joining(spec=placement.joined, prepare=prepare)
            with showing_startup(config.progress, backend.counts):
                await backend.prepare(specs)  # an embedded cluster is sized for all pools
                groups = {m.name: await _start_trainer(backend, config, placement, m) for m in trainers}
                pools = await _start_pools(config, placement, backend, stack, graphs, joining)
                backend.counts.reserved |= backend.counts.groups  # every actor started: so were their groups
            return Deployment(config, placement, backend, stack, groups, pools, joining.lock)
    except BaseException:
        await _close(stack, backend)
        raise


async def _start_pools(
    config: RunConfig,
    placement: Placement,
    backend: Backend,
    stack: contextlib.AsyncExitStack,
    graphs: tuple[FlowGraph, FlowGraph | None],
    joining: Joining,
) -> tuple[AsyncPipeline, AsyncPipeline | None]:
    rollout, evaluation = graphs
    seed = config.seed if config.pipeline.seed is None else config.pipeline.seed
    # the engine's own view covers the pools
    deterministic = config.reproducibility.deterministic or config.pipeline.deterministic
    cfg = msgspec.structs.replace(config.pipeline, progress="off", seed=seed, deterministic=deterministic)
    pipe = await stack.enter_async_context(running(rollout, backend, cfg, placement.spec, joining))
    if evaluation is None:
        return pipe, None
    # its samples are numbered apart from the rollout's: streams of their own; one lock for both pools
    joins_eval = Joining(
        spec=lambda m, r, old: placement.joined(m, r, old, "-eval"), lock=joining.lock, prepare=joining.prepare
    )
    evaluating = await stack.enter_async_context(
        running(
            evaluation,
            backend,
            msgspec.structs.replace(cfg, seed=derived_seed(seed, "eval")),
            lambda m, r: placement.spec(m, r, "-eval"),
            joins_eval,
        )
    )
    return pipe, evaluating


def _pool_specs(placement: Placement, graph: FlowGraph | None, pool: str) -> list[ReplicaSpec]:
    if graph is None:
        return []
    return [placement.spec(m, r, pool) for m in graph.models.values() for r in range(m.config.replicas)]


async def _start_trainer(
    backend: Backend, config: RunConfig, placement: Placement, model: Model
) -> list[ReplicaHandle]:
    specs = [placement.spec(model, r) for r in range(model.config.replicas)]
    return await backend.start_trainer(specs, timeout_s=config.collective_timeout_s)


async def _close(stack: contextlib.AsyncExitStack, backend: Backend) -> None:
    try:
        async with plain_errors():
            await stack.aclose()
    finally:
        with anyio.CancelScope(shield=True):
            await backend.close()
