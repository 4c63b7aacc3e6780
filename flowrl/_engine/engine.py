"""The RL engine: episodes, relay buffer, data-parallel trainers, weight sync.

One episode: draw ``sample_per_episode`` samples from the dataset (ChatLearn's sampler), stream them
through the rollout flow, add them to the relay buffer, train every trainer on the relay output (global
batches split over its ranks), and every ``sync_every`` episodes send each trainer's weights to the
inference model it feeds, through the object store. ``Engine`` is a façade: it checks the settings,
holds what outlives a session (``LearningState``, the timeline), and on entering ``with engine:``
deploys the models and wires the components that work on them (``_wire``) into a ``Session``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import msgspec

from .._core.checks import file_path
from .._core.errors import ConfigError, FlowError, PipelineClosedError
from .._core.flow.graph import check_one_argument
from .._core.names import check_name
from .._core.observe.trace import ENGINE, Span, Timeline, chrome_trace, write_json
from .._core.settings.config import to_config
from .._core.settings.run_config import RunConfig
from .._pipeline.opening import Flow, build_flow, plain_errors
from .._pipeline.progress import interrupted
from .checkpoint_files import CheckpointFormat
from .checkpoints import CheckpointManager
from .deployment import Deployment, deploy
from .elastic import Elasticity
from .engine_view import stopped_line
from .episodes import EpisodeLoop
from .interrupts import until_interrupted
from .learning import CostFn, LearningState, RelayFn, dataset_items
from .models import all_models, apply_model_configs, check, sync_pairs, trainer_models
from .overlap import Overlap
from .placement import Placement
from .replay import Replay, ScheduleLog, check_schedule_settings, schedule_settings
from .run_folder import RunDir
from .survivors import SurvivorRebuild
from .tracking import Tracking
from .training import TrainSteps
from .weight_sync import WeightSync

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path

    from .._backends.specs import ReplicaHandle
    from .._core.flow.batch import Sample
    from .._core.flow.graph import FlowGraph
    from .._core.flow.model import Model
    from .._core.training.sampler import EpisodeBuffer
    from .engine_stats import EngineStats
    from .learning import TrainResults
    from .tracking import Callback, Logger


def _check_trainer_configs(trainers: list[Model], *graphs: FlowGraph | None) -> None:
    """Settings that a trainer group would silently ignore (it is no pool) are refused."""
    pooled = {name for graph in graphs if graph is not None for name in graph.models}
    for m in trainers:
        if m.config.autoscale is not None and m.name not in pooled:
            raise ConfigError(
                f"trainer {m.name!r} has ModelConfig.autoscale, but a trainer is a data-parallel group that keeps "
                "its world size; autoscale the inference models of the rollout flow instead"
            )


@dataclass(frozen=True)
class Session:
    """The components of one `with engine:` block, wired to its deployment."""

    deployment: Deployment
    weights: WeightSync
    elasticity: Elasticity
    episodes: EpisodeLoop


class Engine:
    """Runs episodes of a rollout flow, training and weight sync on a Ray cluster.

    ``train``: the trainer models (or a flow that calls their ``train_step``); ``sync``:
    (trainer, inference model) pairs whose weights flow trainer -> inference after training.
    ``learn()`` outside ``with engine:`` runs once; inside, actors and trainer state persist
    and each ``learn()`` continues where the last stopped. ``callbacks``: functions called with
    an ``EpisodeReport`` after each episode; ``loggers``: objects with the ``Logger`` methods that
    get each episode's scalars (besides the ones ``RunConfig.loggers`` names).
    ``predict_cost``: ``fn(item, remembered) -> float``, a predicted cost (e.g. a response
    length) for each item of a rollout, where ``remembered`` is what ``RunConfig.length_field``
    recorded for its prompt (None if nothing): the rollout starts the costliest first.
    """

    def __init__(
        self,
        *,
        rollout: Flow,
        train: Sequence[Model] | Flow,
        config: RunConfig | Mapping[str, Any],
        sync: Sequence[tuple[Model, Model]] = (),
        eval_flow: Flow | None = None,
        callbacks: Sequence[Callback] = (),
        loggers: Sequence[Logger] = (),
        predict_cost: CostFn | None = None,
    ) -> None:
        self.config: RunConfig = to_config(RunConfig, config, "run config")
        if predict_cost is not None and not callable(predict_cost):
            raise ConfigError(
                f"Engine(predict_cost=...): expected a function (item, remembered) -> float, got a "
                f"{type(predict_cost).__name__}"
            )
        self._tracking = Tracking(self.config, loggers, callbacks)  # a missing package fails here
        self.trainers = trainer_models(train)
        self.rollout_graph = build_flow(rollout)
        self.eval_graph = build_flow(eval_flow) if eval_flow is not None else None
        self.sync_pairs = sync_pairs(sync)
        models = all_models(self.rollout_graph, self.eval_graph, self.trainers)
        for model in models.values():  # `name` is a plain attribute: checked again once all are known
            check_name(model.name, f"model {type(model).__name__}")
        apply_model_configs(self.config, models)
        _check_trainer_configs(self.trainers, self.rollout_graph, self.eval_graph)
        check(self.config, models, self.trainers, self.sync_pairs, self.rollout_graph, self.eval_graph)
        check_schedule_settings(self.config, [t.name for _, t in self.sync_pairs], self.rollout_graph)
        evaluated = self.eval_graph.models if self.eval_graph is not None else {}
        self.placement = Placement(self.config, models, evaluated)
        for _, target in self.sync_pairs:
            target.track_version = True
        self._learning = LearningState(self.config, [m.name for m in self.trainers])
        self._learning.predict_cost = predict_cost
        self._checkpoint_files = CheckpointFormat(self.config)  # a bad resume setting fails here
        self._run_dir = RunDir(self.config.run_dir) if self.config.run_dir else None
        self.timeline = Timeline(self.config.pipeline.trace_spans)  # episode phases, trainer steps
        self._pipe_timelines: list[tuple[str, Timeline]] = []  # the pipelines', by group prefix
        self._session: Session | None = None  # the last `with engine:` block's (kept after it: its stats)
        self._runs = 0  # learn() calls
        self._failed: BaseException | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._sync_stack: contextlib.ExitStack | None = None

    # ---- user inputs ----
    def set_dataset(self, items: Sequence[Mapping[str, Any]]) -> None:
        self._learning.set_dataset(items)

    def set_eval_dataset(self, items: Sequence[Mapping[str, Any]]) -> None:
        self._learning.eval_dataset = dataset_items(items, "eval dataset", "engine.set_eval_dataset(items)")

    def set_relay_sample_fn(self, fn: RelayFn) -> None:
        check_one_argument(fn, "relay function", "the list of episodes the relay buffer holds")
        self._learning.relay_fn = fn

    @property
    def relay_episodes(self) -> list[EpisodeBuffer]:
        """The episodes the relay buffer holds now (the last ``max_relay_episode``)."""
        return list(self._learning.relay.episodes)

    @property
    def train_results(self) -> list[TrainResults]:
        """Per episode, per trainer, per step, per rank: what ``train_step`` returned."""
        return self._learning.train_results

    @property
    def eval_results(self) -> list[list[Sample]]:
        """The samples of each evaluation."""
        return self._learning.eval_results

    @property
    def overlapped(self) -> bool:
        """Whether rollouts run ahead of training (``staleness.max`` > 0, or a drop/regenerate policy)."""
        return self.config.staleness.overlaps

    # ---- running ----
    def learn(self) -> EngineStats:
        """Run ``num_episode`` episodes (synchronous)."""
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            raise FlowError("learn() blocks; inside async code use `await engine.alearn()`")
        try:
            if self._portal is not None:
                return self._learn_in_portal(self._portal)
            return anyio.run(until_interrupted, self.alearn)
        except KeyboardInterrupt:
            raise interrupted(self._stopped_line()) from None

    def _learn_in_portal(self, portal: anyio.from_thread.BlockingPortal) -> EngineStats:
        """``_learn()`` in the portal; a Ctrl-C cancels it there and waits for it to stop (else it
        would go on with the next episode while the stop message is written)."""
        scopes: list[anyio.CancelScope] = []  # made in the portal: a scope needs its event loop

        async def learn() -> EngineStats | None:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                return await self._learn()
            return None

        future = portal.start_task_soon(learn)
        try:
            stats = future.result()
        except KeyboardInterrupt:
            if scopes:
                portal.call(scopes[0].cancel)
            else:  # not begun yet
                future.cancel()
            with contextlib.suppress(Exception):
                future.result()
            raise
        assert stats is not None, "learn() cancelled from elsewhere"
        return stats

    def _stopped_line(self) -> str:
        """The one line a Ctrl-C leaves: where the run stopped, and how to resume it."""
        session = self._session
        if session is None:
            return "flowrl: stopped while starting the actors; no episode ran"
        total = max(self._runs, 1) * self.config.num_episode
        folder = session.episodes.checkpoints.folder
        # the latest as resume="auto" finds it: a write that Ctrl-C cut short once its folder was in
        # place counts, though the engine has not heard back from it
        with contextlib.suppress(OSError, FlowError):
            on_disk = self._checkpoint_files.dir.latest() if self._checkpoint_files.dir is not None else None
            folder = on_disk or folder
        return stopped_line(
            self._learning.episode, total, folder, self.config.checkpoint.dir, self.config.checkpoint.resume
        )

    async def alearn(self) -> EngineStats:
        """Run ``num_episode`` episodes (async)."""
        if self._running() is not None:
            return await self._learn()
        self._ready_to_learn()
        async with self:
            return await self._learn()

    async def _join(self, handle: ReplicaHandle) -> None:
        """A replica joining a pool gets the weights the others hold. Pools grow only while the
        block's components are wired (inside ``learn()`` or a resize), after ``_wire``."""
        assert self._session is not None, "a replica joined before the engine's components were wired"
        await self._session.weights.join(handle)

    def _running(self) -> Session | None:
        """The components at work, inside `with engine:`."""
        return self._session if self._session is not None and self._session.deployment.running else None

    def _ready_to_learn(self) -> None:
        if self._failed is not None:
            raise PipelineClosedError(f"the engine failed earlier: {self._failed!r}") from self._failed
        if self._learning.dataset is None:
            raise ConfigError("call engine.set_dataset(items) before learn()")
        if self.config.eval_every and not self._learning.eval_dataset:
            raise ConfigError(
                f"RunConfig.eval_every={self.config.eval_every}: call engine.set_eval_dataset(items) first"
            )
        if self._runs and self._running() is None:
            raise PipelineClosedError(
                "learn() outside `with engine:` runs once (its actors stop after it); open the engine with "
                "`with engine:` (or `async with engine:`) to call learn() several times and continue"
            )

    async def __aenter__(self) -> Engine:
        if self._running() is not None:
            raise PipelineClosedError("the engine is already running")
        if self._runs:
            raise PipelineClosedError(
                "an engine runs in one `with engine:` block: its actors and trainer state end with the block"
            )
        started = time.time()
        graphs = (self.rollout_graph, self.eval_graph)
        deployment = await deploy(self.config, self.placement, self.trainers, graphs, self._join)
        self.timeline.add(ENGINE, 0, "startup", started, time.time())
        self._session = self._wire(deployment)
        self._pipe_timelines = [("", deployment.rollout.timeline)]
        if deployment.evaluation is not None:
            self._pipe_timelines.append(("eval:", deployment.evaluation.timeline))
        return self

    def _wire(self, deployment: Deployment) -> Session:
        """The components that work on ``deployment``, each handed its collaborators."""
        cfg, learning, files = self.config, self._learning, self._checkpoint_files
        replay = (
            Replay(cfg.reproducibility.replay_schedule, lambda: weights.versions)
            if cfg.reproducibility.replay_schedule
            else None
        )
        weights = WeightSync(cfg, self.sync_pairs, deployment, replay)
        survivors = SurvivorRebuild(cfg, self.trainers, deployment, weights, learning)
        trainers = TrainSteps(cfg, self.trainers, deployment, learning.counters, self.timeline, survivors)
        checkpoints = CheckpointManager(cfg, files, learning, self.trainers, deployment, weights, survivors.restarts)
        synced = [t.name for _, t in self.sync_pairs]
        record = (
            ScheduleLog(cfg.reproducibility.record_schedule, schedule_settings(cfg, synced))
            if cfg.reproducibility.record_schedule
            else None
        )
        overlap = Overlap(cfg, learning, deployment.rollout, weights, files, self.timeline, record, replay)
        elasticity = Elasticity([m.name for m in self.trainers], deployment.rollout)
        parts = (cfg, learning, deployment, trainers, overlap, checkpoints, elasticity, self._run_dir, self.timeline)
        episodes = EpisodeLoop(*parts, syncing=bool(self.sync_pairs), tracking=self._tracking)
        self._tracking.started()
        return Session(deployment, weights, elasticity, episodes)

    async def __aexit__(self, *exc: object) -> None:
        session = self._running()
        try:
            if session is not None:
                await session.deployment.stop()
        finally:  # the loggers' runs end with the engine's, however it ends
            await self._tracking.close(failing=exc[1] is not None or self._failed is not None)

    def __enter__(self) -> Engine:
        # The async context runs in one task of a portal thread (task groups must be left by
        # the task that entered them); learn() calls reach it through the portal.
        stack = contextlib.ExitStack()
        try:
            portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
            self._portal = portal
            stack.enter_context(portal.wrap_async_context_manager(self))
        except KeyboardInterrupt:
            self._portal = None
            stack.close()
            raise interrupted(self._stopped_line()) from None
        except BaseException:
            self._portal = None
            stack.close()
            raise
        self._sync_stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._sync_stack, self._portal = self._sync_stack, None, None
        if stack is None:
            return
        try:
            stack.__exit__(*exc)
        except FlowError as err:
            if err is not self._failed and err is not exc[1]:
                raise

    def stats(self) -> EngineStats:
        if self._session is None:
            return self._learning.stats((None, None), [])
        deployment = self._session.deployment
        return self._learning.stats(deployment.stats(), deployment.replaced())

    async def _learn(self) -> EngineStats:
        self._ready_to_learn()
        session = self._running()
        assert session is not None, "_learn() outside `with engine:`"
        self._runs += 1
        try:
            async with plain_errors():
                # the n-th learn() runs up to episode n * num_episode: a resumed run ends where
                # the uninterrupted one would have
                await session.episodes.learn(self._runs * self.config.num_episode)
        except Exception as err:
            self._failed = err  # a trainer group may be stuck in a collective: no more runs
            raise
        finally:
            if self._run_dir is not None:
                self._run_dir.trace(self.spans())
        return self.stats()

    def resize(self, model: str, replicas: int) -> list[int]:
        """Grow or shrink inference model ``model``'s rollout pool to ``replicas`` while the
        engine runs (call it from another thread during ``learn()``, or between calls); the
        replica ids added or removed. A replica removed finishes the shards it holds first;
        one added gets the weights the others hold before its first shard."""
        if self._portal is None:
            raise PipelineClosedError("resize() needs an engine open with `with engine:` (async: await aresize())")
        return self._portal.call(self.aresize, model, replicas)

    async def aresize(self, model: str, replicas: int) -> list[int]:
        session = self._running()
        if session is None:
            raise PipelineClosedError("the engine is not running: resize it inside `with engine:`")
        return await session.elasticity.resize(model, replicas)

    def spans(self) -> list[Span]:
        """The timeline so far: episode phases (group ``"engine"``), trainer steps (a lane per
        rank), a span per shard of every replica (eval pools' groups prefixed ``eval:``)."""
        out = self.timeline.spans
        for prefix, timeline in self._pipe_timelines:
            out += [msgspec.structs.replace(s, group=prefix + s.group) if prefix else s for s in timeline.spans]
        return out

    def write_trace(self, path: str | Path) -> Path:
        """Write ``spans()`` as a Chrome trace (JSON; Perfetto and chrome://tracing open it)."""
        return write_json(file_path(path, "Engine.write_trace(path)"), chrome_trace(self.spans()))
