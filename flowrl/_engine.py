"""The RL engine (layer 6): episodes, relay buffer, data-parallel trainers, weight sync.

One episode: draw ``sample_per_episode`` samples from the dataset (ChatLearn's sampler),
stream them through the rollout flow, add them to the relay buffer, train every trainer on
the relay output (global batches split over its ranks), and every ``sync_every`` episodes
send each trainer's weights to the inference model it feeds, through the object store.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import anyio.from_thread
import msgspec

from ._backend import Bundle, ReplicaHandle, ReplicaSpec, make_backend
from ._batch import Batch, Sample
from ._config import to_config
from ._errors import ConfigError, FlowDefinitionError
from ._model import Model
from ._pipeline import Flow, build_flow, plain_errors, running
from ._run_config import RunConfig
from ._runtime import AsyncPipeline
from ._sampler import EpisodeBuffer, EpisodeSampler, RelayBuffer, check_train_sizes, plan_steps
from ._stats import PipelineStats

RelayFn = Callable[[list[EpisodeBuffer]], Sequence[Sample]]


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
    """One episode: its phases' seconds, mean train metrics per trainer, weight versions after it."""

    episode: int
    samples: int
    rollout_s: float
    train_s: float
    sync_s: float
    eval_s: float
    metrics: dict[str, dict[str, float]]
    weight_versions: dict[str, int]


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    rollout: PipelineStats | None
    evaluation: PipelineStats | None
    trainers: dict[str, TrainerStats]
    episodes: list[EpisodeStats]


def _trainers(train: Sequence[Model] | Flow) -> list[Model]:
    if callable(train) and not isinstance(train, Model):
        graph = build_flow(train)
        models = [graph.models[s.model] for s in graph.stages.values()]
        bad = [s.name for s in graph.stages.values() if s.method != "train_step"]
        if bad:
            raise FlowDefinitionError(f"a train flow calls train_step only; it calls {bad}")
        return list(dict.fromkeys(models))
    models = list(train)
    for m in models:
        if not isinstance(m, Model) or getattr(type(m), "train_step", None) is None:
            raise FlowDefinitionError(f"train: expected models that define train_step, got {m!r}")
    return models


class Engine:
    """Runs episodes of a rollout flow, training and weight sync on a Ray cluster.

    ``train``: the trainer models (or a flow that calls their ``train_step``); ``sync``:
    (trainer, inference model) pairs whose weights flow trainer -> inference after training.
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
        self.trainers = _trainers(train)
        self.rollout_graph = build_flow(rollout)
        self.eval_graph = build_flow(eval_flow) if eval_flow is not None else None
        self.sync_pairs = list(sync)
        self._apply_model_configs()
        self._check()
        for _, target in self.sync_pairs:
            target._flowrl_track_version = True  # type: ignore[attr-defined]
        self._dataset: list[Mapping[str, Any]] | None = None
        self._eval_dataset: list[Mapping[str, Any]] | None = None
        self._relay_fn: RelayFn | None = None
        self._sampler: EpisodeSampler | None = None
        self._relay = RelayBuffer(self.config.max_relay_episode)
        self._episode = 0
        self._versions = {t.name: 0 for _, t in self.sync_pairs}
        self._episodes: list[EpisodeStats] = []
        self._train_counts: dict[str, dict[int, list[float]]] = {m.name: {} for m in self.trainers}
        self.train_results: list[dict[str, list[list[dict[str, Any]]]]] = []  # per episode, trainer, step, rank
        self.eval_results: list[list[Sample]] = []
        self._live: _Live | None = None

    # ---- set-up checks, all before anything starts ----
    def _all_models(self) -> dict[str, Model]:
        models = dict(self.rollout_graph.models)
        if self.eval_graph is not None:
            models.update(self.eval_graph.models)
        for m in self.trainers:
            if models.setdefault(m.name, m) is not m:
                raise FlowDefinitionError(f"two different models are named {m.name!r}")
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
        models = self._all_models()
        for m in self.trainers:
            check_train_sizes(
                global_batch=self.config.global_batch, micro_batch=self.config.micro_batch,
                dp=m.config.replicas, group=self.config.num_samples_per_prompt,
            )
        for trainer, target in self.sync_pairs:
            if trainer not in self.trainers or target.name not in self.rollout_graph.models:
                raise ConfigError(
                    f"sync pair ({trainer.name!r} -> {target.name!r}): the first must be a trainer and the "
                    "second a model of the rollout flow"
                )
        grouped = [n for g in self.config.colocation for n in g]
        unknown = sorted(set(grouped) - models.keys())
        if unknown:
            raise ConfigError(f"RunConfig.colocation names unknown model(s) {unknown}; the models are {sorted(models)}")
        for name in grouped:
            if models[name].config.replica_gpus > 1:
                raise ConfigError(
                    f"colocation: model {name!r} has replicas of {models[name].config.replica_gpus:g} GPUs; colocated "
                    "replicas hold at most one GPU each for now (set gpus_per_replica <= 1, or leave it out)"
                )

    def _bundle(self, model: Model, replica: int) -> Bundle | None:
        """GPU replicas are placed through placement groups: a colocation group's (one GPU per
        bundle, shared) or their own model's (one bundle per replica)."""
        gpus = model.config.replica_gpus
        if gpus <= 0:
            return None
        for gi, group in enumerate(self.config.colocation):
            if model.name in group:
                configs = [self._all_models()[n].config for n in group]
                size = max(1, max(math.ceil(c.replicas * c.replica_gpus) for c in configs))
                cpus = sum(c.cpus_per_replica * math.ceil(c.replicas / size) for c in configs)
                return Bundle(f"colocate-{gi}", int(replica * gpus) % size, size, round(cpus, 4))
        return Bundle(f"model-{model.name}", replica, model.config.replicas, model.config.cpus_per_replica, gpus)

    def _spec(self, model: Model, replica: int) -> ReplicaSpec:
        bundle = self._bundle(model, replica)
        gpus = model.config.replica_gpus
        group = next((g for g in self.config.colocation if model.name in g), None)
        if bundle is not None and group is not None:  # share each GPU among the group's models
            gpus = math.floor(gpus / len(group) * 10_000) / 10_000  # Ray counts in 1e-4 steps
        return ReplicaSpec(model, replica, model.config.cpus_per_replica, gpus, bundle)

    # ---- user inputs ----
    def set_dataset(self, items: Sequence[Mapping[str, Any]]) -> None:
        items = list(items)
        self._sampler = EpisodeSampler(
            len(items), self.config.sample_per_episode, self.config.num_samples_per_prompt,
            self.config.shuffle, self.config.seed,
        ) if items else None
        if not items:
            raise ConfigError("set_dataset: the dataset is empty")
        self._dataset = items

    def set_eval_dataset(self, items: Sequence[Mapping[str, Any]]) -> None:
        self._eval_dataset = list(items)

    def set_relay_sample_fn(self, fn: RelayFn) -> None:
        self._relay_fn = fn

    # ---- running ----
    def learn(self) -> EngineStats:
        """Run ``num_episode`` episodes (synchronous; inside ``with engine:`` the actors persist)."""
        if self._live is not None and self._live.portal is not None:
            return self._live.portal.call(self._learn)
        return anyio.run(self.alearn)

    async def alearn(self) -> EngineStats:
        """Run ``num_episode`` episodes (async)."""
        if self._live is not None:
            return await self._learn()
        async with self:
            return await self._learn()

    async def __aenter__(self) -> Engine:
        if self._live is not None:
            raise ConfigError("the engine is already running")
        live = _Live(self)
        await live.start()
        self._live = live
        return self

    async def __aexit__(self, *exc: Any) -> None:
        live, self._live = self._live, None
        if live is not None:
            await live.stop()

    def __enter__(self) -> Engine:
        # The async context runs in one task of a portal thread (task groups must be left by
        # the task that entered them); learn() calls reach it through the portal.
        stack = contextlib.ExitStack()
        try:
            portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
            stack.enter_context(portal.wrap_async_context_manager(self))  # type: ignore[arg-type]
        except BaseException:
            stack.close()
            raise
        assert self._live is not None
        self._live.portal, self._live.sync_stack = portal, stack
        return self

    def __exit__(self, *exc: Any) -> None:
        live = self._live
        if live is not None and live.sync_stack is not None:
            live.sync_stack.__exit__(*exc)

    def stats(self) -> EngineStats:
        live = self._live
        trainers = {
            name: TrainerStats(
                model=name,
                samples=sum(int(v[0]) for v in ranks.values()),
                steps=max((int(v[1]) for v in ranks.values()), default=0),
                ranks=[RankStats(rank=r, samples=int(v[0]), steps=int(v[1]), busy_s=v[2]) for r, v in sorted(ranks.items())],
            )
            for name, ranks in self._train_counts.items()
        }
        return EngineStats(
            rollout=live.rollout.stats() if live and live.rollout else self._last_rollout_stats,
            evaluation=live.evaluation.stats() if live and live.evaluation else self._last_eval_stats,
            trainers=trainers,
            episodes=list(self._episodes),
        )

    _last_rollout_stats: PipelineStats | None = None
    _last_eval_stats: PipelineStats | None = None

    async def _learn(self) -> EngineStats:
        if self._dataset is None or self._sampler is None:
            raise ConfigError("call engine.set_dataset(items) before learn()")
        live = self._live
        assert live is not None
        async with plain_errors():
            for _ in range(self.config.num_episode):
                await self._run_episode(live)
        return self.stats()

    async def _run_episode(self, live: _Live) -> None:
        e, cfg = self._episode, self.config
        t0 = time.perf_counter()
        samples = await live.rollout.run(self._episode_items())  # type: ignore[union-attr]
        t1 = time.perf_counter()
        self._relay.add(EpisodeBuffer(e, samples))
        train_samples = list(self._relay_fn(self._relay.episodes)) if self._relay_fn else samples
        results = {}
        async with anyio.create_task_group() as tg:
            for m in self.trainers:
                results[m.name] = []
                tg.start_soon(self._train, live, m, train_samples, e, results[m.name])
        self.train_results.append(results)
        t2 = time.perf_counter()
        if (e + 1) % cfg.sync_every == 0:
            await self._sync(live)
        t3 = time.perf_counter()
        if cfg.eval_every and (e + 1) % cfg.eval_every == 0 and self._eval_dataset:
            self.eval_results.append(await live.evaluation.run(self._eval_dataset))  # type: ignore[union-attr]
        self._episodes.append(EpisodeStats(
            episode=e, samples=len(samples), rollout_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2,
            eval_s=time.perf_counter() - t3, metrics={k: _mean_metrics(v) for k, v in results.items()},
            weight_versions=dict(self._versions),
        ))
        self._episode += 1

    def _episode_items(self) -> list[dict[str, Any]]:
        assert self._sampler is not None and self._dataset is not None
        n = self.config.num_samples_per_prompt
        items = []
        for prompt, copy in self._sampler.next_episode():
            item = dict(self._dataset[prompt])
            if n > 1:  # GRPO groups: which prompt, which copy
                item.update(prompt_index=prompt, copy_index=copy)
            items.append(item)
        return items

    async def _train(self, live: _Live, model: Model, samples: Sequence[Sample], episode: int, out: list[Any]) -> None:
        ranks = live.trainers[model.name]
        cfg = self.config
        steps = plan_steps(len(samples), global_batch=cfg.global_batch, micro_batch=cfg.micro_batch,
                           dp=len(ranks), group=cfg.num_samples_per_prompt)
        counts = self._train_counts[model.name]
        for _ in range(cfg.num_training_epoch):
            for step in steps:
                shards = [_rows(samples, [r for mb in rank for r in mb]) for rank in step.ranks]
                results: list[Any] = [None] * len(ranks)

                async def one(i: int, handle: ReplicaHandle, batch: Batch) -> None:
                    results[i] = await live.backend.train(handle, batch, step.size, cfg.micro_batch, episode)

                async with anyio.create_task_group() as tg:
                    for i, (handle, batch) in enumerate(zip(ranks, shards)):
                        tg.start_soon(one, i, handle, batch)
                for i, res in enumerate(results):
                    c = counts.setdefault(i, [0, 0, 0.0])
                    c[0] += res.pop("_samples")
                    c[1] += 1
                    c[2] += res.pop("_busy_s")
                out.append(results)

    async def _sync(self, live: _Live) -> None:
        for trainer, target in self.sync_pairs:
            weights = await live.backend.get_weights(live.trainers[trainer.name][0])
            self._versions[target.name] += 1
            version = self._versions[target.name]
            targets = [h for pipe in live.pipelines() for h in pipe._handles if h.model == target.name]
            async with anyio.create_task_group() as tg:
                for handle in targets:
                    tg.start_soon(live.backend.load_weights, handle, version, weights)


def _rows(samples: Sequence[Sample], rows: list[int]) -> Batch:
    picked = [samples[r] for r in rows]
    return Batch.from_samples([s.id for s in picked], [dict(s) for s in picked])


def _mean_metrics(steps: list[list[dict[str, Any]]]) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for step in steps:
        for rank in step:
            for k, v in rank.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    sums.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sums.items()}


class _Live:
    """The running parts of an engine: backend, trainer groups, rollout and eval pipelines."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.backend = make_backend(engine.config.pipeline)
        self.stack = contextlib.AsyncExitStack()
        self.trainers: dict[str, list[ReplicaHandle]] = {}
        self.rollout: AsyncPipeline | None = None
        self.evaluation: AsyncPipeline | None = None
        self.portal: Any = None
        self.sync_stack: contextlib.ExitStack | None = None

    def pipelines(self) -> list[AsyncPipeline]:
        return [p for p in (self.rollout, self.evaluation) if p is not None]

    async def start(self) -> None:
        e = self.engine
        try:
            async with plain_errors():
                await self._start_parts()
        except BaseException:
            await self.stop()
            raise

    async def _start_parts(self) -> None:
        e = self.engine
        everything = [e._spec(m, r) for m in e._all_models().values() for r in range(m.config.replicas)]
        await self.backend.prepare(everything)  # an embedded cluster is sized for all pools
        cfg = e.config.pipeline
        for m in e.trainers:
            specs = [e._spec(m, r) for r in range(m.config.replicas)]
            self.trainers[m.name] = await self.backend.start_trainer(specs, timeout_s=cfg.setup_timeout_s)
        self.rollout = await self.stack.enter_async_context(running(e.rollout_graph, self.backend, cfg, e._spec))
        if e.eval_graph is not None:
            self.evaluation = await self.stack.enter_async_context(running(e.eval_graph, self.backend, cfg, e._spec))

    async def stop(self) -> None:
        e = self.engine
        if self.rollout is not None:
            e._last_rollout_stats = self.rollout.stats()
        if self.evaluation is not None:
            e._last_eval_stats = self.evaluation.stats()
        try:
            async with plain_errors():
                await self.stack.aclose()
        finally:
            with anyio.CancelScope(shield=True):
                await self.backend.close()
