"""The RL engine (layer 6): episodes, relay buffer, data-parallel trainers, weight sync.

One episode: draw ``sample_per_episode`` samples from the dataset (ChatLearn's sampler),
stream them through the rollout flow, add them to the relay buffer, train every trainer on
the relay output (global batches split over its ranks), and every ``sync_every`` episodes
send each trainer's weights to the inference model it feeds, through the object store.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import msgspec

from .._core.batch import Sample
from .._core.config import to_config
from .._core.errors import ConfigError, FlowError, PipelineClosedError, ReplicaDiedError, StageError
from .._core.run_config import RunConfig
from .._core.sampler import EpisodeBuffer, EpisodeSampler, RelayBuffer, check_train_sizes
from .._core.staleness import histogram
from .._core.trace import ENGINE, Span, Timeline, chrome_trace, write_json
from .._pipeline.opening import Flow, build_flow, plain_errors
from .._pipeline.progress import Progress
from .checkpoints import Checkpoints, Resumable
from .elastic import Elastic
from .overlap import Gate, Overlap, Rollout
from .parts import (
    EngineStats,
    EpisodeStats,
    Live,
    Placement,
    RankStats,
    TrainerStats,
    mean_metrics,
    relayed,
    trainer_models,
)
from .run_folder import RunDir, metric_values
from .training import Training, batch_of

if TYPE_CHECKING:
    from pathlib import Path

    from .._core.model import Model

RelayFn = Callable[[list[EpisodeBuffer]], Sequence[Sample]]
GROUP_FIELDS = ("prompt_index", "copy_index")


class Engine(Training, Overlap, Elastic, Resumable):
    """Runs episodes of a rollout flow, training and weight sync on a Ray cluster.

    ``train``: the trainer models (or a flow that calls their ``train_step``); ``sync``:
    (trainer, inference model) pairs whose weights flow trainer -> inference after training.
    ``learn()`` outside ``with engine:`` runs once; inside, actors and trainer state persist
    and each ``learn()`` continues where the last stopped.
    """

    def __init__(
        self,
        *,
        rollout: Flow,
        train: Sequence[Model] | Flow,
        config: RunConfig | Mapping[str, Any],
        sync: Sequence[tuple[Model, Model]] = (),
        eval_flow: Flow | None = None,
    ) -> None:
        self.config: RunConfig = to_config(RunConfig, config, "run config")
        self.trainers = trainer_models(train)
        self.rollout_graph = build_flow(rollout)
        self.eval_graph = build_flow(eval_flow) if eval_flow is not None else None
        self.sync_pairs = list(sync)
        self._apply_model_configs()
        self._check()
        self.placement = Placement(self.config, self._all_models())
        for _, target in self.sync_pairs:
            target.track_version = True
        self._dataset: list[Mapping[str, Any]] | None = None
        self._eval_dataset: list[Mapping[str, Any]] | None = None
        self._relay_fn: RelayFn | None = None
        self._sampler: EpisodeSampler | None = None
        self._relay = RelayBuffer(self.config.max_relay_episode)
        self._episode = 0
        self._versions = {t.name: 0 for _, t in self.sync_pairs}
        self._episodes: list[EpisodeStats] = []
        self._counts: dict[str, dict[int, list[float]]] = {m.name: {} for m in self.trainers}
        self.train_results: list[dict[str, list[list[dict[str, Any]]]]] = []  # episode -> trainer -> step -> rank
        self.eval_results: list[list[Sample]] = []
        self._live: Live | None = None
        self._runs = 0
        self._failed: BaseException | None = None
        self._portal: Any = None
        self._sync_stack: contextlib.ExitStack | None = None
        self._ckpt = Checkpoints(self.config)
        self._begun = False  # resumed from a checkpoint, or wrote the first one
        self._restarts = 0
        self._sent: dict[str, Any] = {}  # inference model -> reference to the weights it holds
        self._groups: dict[str, Any] = {}  # inference model -> its weight-broadcast group (nccl)
        self._initial: dict[str, Any] = {}  # its weights before the first sync
        self._folder: Path | None = None  # the last checkpoint written or resumed from
        self.timeline = Timeline(self.config.pipeline.trace_spans)  # episode phases, trainer steps
        self._pipe_timelines: list[tuple[str, Timeline]] = []  # the pipelines', by group prefix
        self._run_dir = RunDir(self.config.run_dir) if self.config.run_dir else None
        self._gate = Gate(0)  # episodes trained and synced: rollouts ahead of training wait on it
        self._marks: dict[int, tuple[int, int]] = {}  # episode -> (sampler position, next sample id) at its start
        self._progress = Progress("off", 0)

    # ---- set-up checks, all before anything starts ----
    def _all_models(self) -> dict[str, Model]:
        models = dict(self.rollout_graph.models)
        for m in [*(self.eval_graph.models.values() if self.eval_graph else ()), *self.trainers]:
            if models.setdefault(m.name, m) is not m:
                raise ConfigError(f"two different models are named {m.name!r}")
        return models

    def _apply_model_configs(self) -> None:
        models = self._all_models()
        unknown = sorted(set(self.config.models) - models.keys())
        if unknown:
            raise ConfigError(f"RunConfig.models names unknown model(s) {unknown}; the models are {sorted(models)}")
        for name, cfg in self.config.models.items():
            models[name].config = cfg
            models[name].num_replicas = cfg.replicas

    def _check(self) -> None:
        cfg, models = self.config, self._all_models()
        EpisodeSampler(1, cfg.sample_per_episode, cfg.num_samples_per_prompt)  # whole groups per episode
        for m in self.trainers:
            check_train_sizes(
                global_batch=cfg.global_batch,
                micro_batch=cfg.micro_batch,
                dp=m.config.replicas,
                group=cfg.num_samples_per_prompt,
            )
        for trainer, target in self.sync_pairs:
            if trainer not in self.trainers or target.name not in self.rollout_graph.models:
                raise ConfigError(
                    f"sync pair ({trainer.name!r} -> {target.name!r}): the first must be a trainer and the "
                    "second a model of the rollout flow"
                )
        direct = [t.name for t, _ in self.sync_pairs if t.config.weight_transport != "host"]
        if direct and cfg.checkpoint_every and cfg.sync_every > 1:
            raise ConfigError(
                f"trainer(s) {direct} send weights by CUDA IPC or NCCL, which a checkpoint between two syncs cannot "
                f"save (RunConfig.sync_every={cfg.sync_every} with checkpoint_every={cfg.checkpoint_every}); set "
                "sync_every=1 or weight_transport='host'"
            )
        if cfg.eval_every and self.eval_graph is None:
            raise ConfigError(f"RunConfig.eval_every={cfg.eval_every} but the engine has no eval_flow")
        unknown = sorted({n for g in cfg.colocation for n in g} - models.keys())
        if unknown:
            raise ConfigError(f"RunConfig.colocation names unknown model(s) {unknown}; the models are {sorted(models)}")

    # ---- user inputs ----
    def set_dataset(self, items: Sequence[Mapping[str, Any]]) -> None:
        items = list(items)
        bad = next((i for i, item in enumerate(items) if not isinstance(item, Mapping)), None)
        if bad is not None:
            raise ConfigError(
                f"dataset item {bad} is a {type(items[bad]).__name__}; items must be mappings of field -> value, "
                "e.g. {'prompt': x}"
            )
        cfg = self.config
        if cfg.num_samples_per_prompt > 1 and any(f in item for item in items for f in GROUP_FIELDS):
            raise ConfigError(
                f"dataset items must not have fields {list(GROUP_FIELDS)}: the engine adds them for groups"
            )
        self._sampler = EpisodeSampler(
            len(items), cfg.sample_per_episode, cfg.num_samples_per_prompt, cfg.shuffle, cfg.seed
        )
        self._dataset = items

    def set_eval_dataset(self, items: Sequence[Mapping[str, Any]]) -> None:
        self._eval_dataset = list(items)

    def set_relay_sample_fn(self, fn: RelayFn) -> None:
        self._relay_fn = fn

    @property
    def relay_episodes(self) -> list[EpisodeBuffer]:
        """The episodes the relay buffer holds now (the last ``max_relay_episode``)."""
        return list(self._relay.episodes)

    # ---- running ----
    def learn(self) -> EngineStats:
        """Run ``num_episode`` episodes (synchronous)."""
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop()
            raise FlowError("learn() blocks; inside async code use `await engine.alearn()`")
        if self._portal is not None:
            return self._portal.call(self._learn)
        return anyio.run(self.alearn)

    async def alearn(self) -> EngineStats:
        """Run ``num_episode`` episodes (async)."""
        if self._live is not None:
            return await self._learn()
        self._ready_to_learn()
        async with self:
            return await self._learn()

    def _ready_to_learn(self) -> None:
        if self._failed is not None:
            raise PipelineClosedError(f"the engine failed earlier: {self._failed!r}") from self._failed
        if self._dataset is None:
            raise ConfigError("call engine.set_dataset(items) before learn()")
        if self.config.eval_every and not self._eval_dataset:
            raise ConfigError(
                f"RunConfig.eval_every={self.config.eval_every}: call engine.set_eval_dataset(items) first"
            )
        if self._runs and self._live is None:
            raise PipelineClosedError(
                "learn() outside `with engine:` runs once (its actors stop after it); open the engine with "
                "`with engine:` (or `async with engine:`) to call learn() several times and continue"
            )

    async def __aenter__(self) -> Engine:
        if self._live is not None:
            raise PipelineClosedError("the engine is already running")
        if self._runs:
            raise PipelineClosedError(
                "an engine runs in one `with engine:` block: its actors and trainer state end with the block"
            )
        live = Live(self.config, self.placement, self.trainers, self.rollout_graph, self.eval_graph)
        await live.start()
        for pipe in (live.rollout, live.evaluation):
            if pipe is not None:
                pipe.join_hook = lambda handle, live=live: self._join(live, handle)
        self._live = live
        self._pipe_timelines = [
            (prefix, p.timeline) for prefix, p in (("", live.rollout), ("eval:", live.evaluation)) if p is not None
        ]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        live, self._live = self._live, None
        if live is not None:
            await live.stop()
            self._last = live.last_stats

    def __enter__(self) -> Engine:
        # The async context runs in one task of a portal thread (task groups must be left by
        # the task that entered them); learn() calls reach it through the portal.
        stack = contextlib.ExitStack()
        try:
            self._portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
            stack.enter_context(self._portal.wrap_async_context_manager(self))  # type: ignore[arg-type]
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

    _last: tuple[Any, Any] = (None, None)

    def stats(self) -> EngineStats:
        rollout, evaluation = self._live.stats() if self._live is not None else self._last
        trainers = {}
        for name, ranks in self._counts.items():
            per_rank = [
                RankStats(rank=r, samples=int(v[0]), steps=int(v[1]), busy_s=v[2]) for r, v in sorted(ranks.items())
            ]
            trainers[name] = TrainerStats(
                model=name,
                samples=sum(r.samples for r in per_rank),
                steps=max((r.steps for r in per_rank), default=0),
                ranks=per_rank,
            )
        return EngineStats(rollout=rollout, evaluation=evaluation, trainers=trainers, episodes=list(self._episodes))

    async def _learn(self) -> EngineStats:
        self._ready_to_learn()
        live = self._live
        assert live is not None
        self._runs += 1
        try:
            async with plain_errors():
                await self._begin(live)
                # the n-th learn() runs up to episode n * num_episode: a resumed run ends where
                # the uninterrupted one would have
                target = self._runs * self.config.num_episode
                self._progress = Progress(self.config.progress, target, self._episode)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._progress.watch, live.rollout, self.config.sample_per_episode)
                    if self._run_dir is not None:
                        tg.start_soon(self._watch_requests, self._run_dir.path)
                    if self.overlapped:
                        await self._learn_overlapped(live, target)
                    while self._episode < target:
                        await self._or_rebuild(live, self._run_episode, target)
                    tg.cancel_scope.cancel()
        except Exception as err:
            self._failed = err  # a trainer group may be stuck in a collective: no more runs
            raise
        finally:
            if self._run_dir is not None:
                self._run_dir.trace(self.spans())
        return self.stats()

    def spans(self) -> list[Span]:
        """The timeline so far: episode phases (group ``"engine"``), trainer steps (a lane per
        rank), a span per shard of every replica (eval pools' groups prefixed ``eval:``)."""
        out = self.timeline.spans
        for prefix, timeline in self._pipe_timelines:
            out += [msgspec.structs.replace(s, group=prefix + s.group) if prefix else s for s in timeline.spans]
        return out

    def write_trace(self, path: str | Path) -> Path:
        """Write ``spans()`` as a Chrome trace (JSON; Perfetto and chrome://tracing open it)."""
        return write_json(path, chrome_trace(self.spans()))

    async def _or_rebuild(self, live: Live, step: Callable[[Live, int], Awaitable[None]], target: int) -> None:
        """``step``; a trainer rank that died in it rebuilds the trainer from the last checkpoint."""
        try:
            async with plain_errors():
                await step(live, target)
        except StageError as err:
            trainer = err.stage.partition(".")[0]
            if trainer not in live.trainers:
                raise
            if not isinstance(err, ReplicaDiedError):
                # a peer of a rank that died may report its broken collective first
                dead = [r.replica_id for r in live.trainers[trainer] if not await live.backend.alive(r)]
                if not dead:
                    raise
                err = ReplicaDiedError(
                    f"the process of rank {dead[0]} died; a peer reported {err.message}",
                    err.stage,
                    dead[0],
                    err.sample_ids,
                )
            await self._rebuild(live, trainer, err)

    async def _run_episode(self, live: Live, target: int) -> None:
        rollout, _ = await self._roll_one(live, self._episode)
        rollout.waited = rollout.ended - rollout.started
        await self._train_episode(live, rollout)

    async def _train_episode(self, live: Live, rollout: Rollout) -> None:
        e, cfg, samples = self._episode, self.config, rollout.samples
        offset, evals = time.time() - time.perf_counter(), len(self.eval_results)  # perf_counter -> wall clock
        t1 = time.perf_counter()
        self._relay.add(EpisodeBuffer(e, samples))
        # an episode whose samples were all dropped (on_stale="drop") trains nothing
        train_samples = relayed(self._relay_fn, self.relay_episodes) if self._relay_fn and samples else samples
        versions = self._train_versions(e)
        lags = histogram(train_samples, versions)
        if self.overlapped:
            train_samples = self._bounded(samples, train_samples, versions)
        results: dict[str, list[Any]] = {m.name: [] for m in self.trainers}
        if train_samples:
            batch = batch_of(train_samples)
            async with anyio.create_task_group() as tg:
                for m in self.trainers:
                    tg.start_soon(self._train, live, m, batch, e, results[m.name])
        t2 = time.perf_counter()
        synced = (e + 1) % cfg.sync_every == 0
        await self._after_training(live, e, synced)  # the sync, or its start; then the gate
        t3 = time.perf_counter()
        if cfg.eval_every and (e + 1) % cfg.eval_every == 0 and self._eval_dataset:
            self.eval_results.append(await live.evaluation.run(self._eval_dataset))  # type: ignore[union-attr]
        t4 = time.perf_counter()
        self._episodes.append(
            EpisodeStats(
                episode=e,
                samples=len(samples),
                rollout_s=rollout.ended - rollout.started,
                train_s=t2 - t1,
                sync_s=t3 - t2,
                eval_s=t4 - t3,
                wait_s=rollout.waited,
                dropped=rollout.dropped,
                regenerated=rollout.regenerated,
                metrics={k: mean_metrics(v) for k, v in results.items()},
                staleness=lags,
                weight_versions=self._train_versions(e + 1),
            )
        )
        phases = (
            ("rollout", rollout.started, rollout.ended, True),
            ("train", t1, t2, bool(train_samples)),
            ("sync", t2, t3, synced and bool(self.sync_pairs)),
            ("eval", t3, t4, len(self.eval_results) > evals),
        )
        for phase, start, end, ran in phases:
            if ran:  # overlapped rollouts get a lane of their own
                lane = int(phase == "rollout" and self.overlapped)
                self.timeline.add(ENGINE, lane, phase, offset + start, offset + end, episode=e)
        self.train_results.append(results)  # with the episode's end: a rebuild undoes whole episodes
        await self._episode_end(live)

    async def _episode_end(self, live: Live) -> None:
        stats = self.stats()
        if self._run_dir is not None:
            self._run_dir.episode(stats)
        live.backend.export_metrics(metric_values(stats))
        self._episode += 1
        if self._ckpt.due(self._episode):
            await self._save(live)
        self._progress.episode_done(self._episodes[-1], live.rollout)

    def _episode_items(self) -> list[dict[str, Any]]:
        assert self._sampler is not None and self._dataset is not None
        grouped = self.config.num_samples_per_prompt > 1
        items = []
        for prompt, copy in self._sampler.next_episode():
            item = dict(self._dataset[prompt])
            if grouped:  # GRPO groups: which prompt, which copy
                item.update(prompt_index=prompt, copy_index=copy)
            items.append(item)
        return items
