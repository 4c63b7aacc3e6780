"""An engine's models and its set-up checks, all done before anything starts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import msgspec

from .._core.errors import ConfigError, FlowDefinitionError
from .._core.flow.model import Model, mark_synced
from .._core.training.sampler import EpisodeSampler, check_train_sizes
from .._pipeline.blocks import check_deterministic
from .._pipeline.opening import Flow, build_flow

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._core.flow.graph import FlowGraph
    from .._core.settings.run_config import RunConfig


def trainer_models(train: Sequence[Model] | Flow) -> list[Model]:
    """The trainers of ``Engine(train=...)``: models, or a flow that calls their ``train_step``."""
    if callable(train) and not isinstance(train, Model):
        graph = build_flow(train)
        bad = [s.name for s in graph.stages.values() if s.method != "train_step"]
        if bad:
            raise FlowDefinitionError(f"a train flow calls train_step only; it calls {bad}")
        return list(dict.fromkeys(graph.models[s.model] for s in graph.stages.values()))
    if isinstance(train, Model):
        raise FlowDefinitionError(
            f"Engine(train=...): expected a list of models, got one model; use train=[{train.name}]"
        )
    if isinstance(train, (str, bytes)) or not isinstance(train, Iterable):
        raise FlowDefinitionError(
            f"Engine(train=...): expected a list of models that define train_step, or a flow calling them, "
            f"got {type(train).__name__}"
        )
    models = list(train)
    for m in models:
        if not isinstance(m, Model) or getattr(type(m), "train_step", None) is None:
            raise FlowDefinitionError(f"train: expected models that define train_step, got {m!r}")
    return models


def sync_pairs(sync: object) -> list[tuple[Model, Model]]:
    """``Engine(sync=...)`` as a list of (trainer, rollout model) pairs of models."""
    if isinstance(sync, (str, bytes, Mapping)) or not isinstance(sync, Iterable):
        raise ConfigError(f"Engine(sync=...): expected a list of (trainer, model) pairs, got {type(sync).__name__}")
    pairs = list(sync)
    for pos, pair in enumerate(pairs):
        ok = isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(m, Model) for m in pair)
        if not ok:
            raise ConfigError(
                f"Engine(sync=...) item {pos}: expected a (trainer, model) pair of flowrl.Models, got {pair!r}"
            )
    return [(trainer, target) for trainer, target in pairs]


def all_models(rollout: FlowGraph, evaluation: FlowGraph | None, trainers: list[Model]) -> dict[str, Model]:
    """Every model of the engine by name; two models of one name are refused."""
    models = dict(rollout.models)
    for m in [*(evaluation.models.values() if evaluation else ()), *trainers]:
        if models.setdefault(m.name, m) is not m:
            raise ConfigError(f"two different models are named {m.name!r}")
    return models


def apply_model_configs(config: RunConfig, models: dict[str, Model]) -> None:
    """``RunConfig.models`` overrides the configs the models were made with."""
    unknown = sorted(set(config.models) - models.keys())
    if unknown:
        raise ConfigError(f"RunConfig.models names unknown model(s) {unknown}; the models are {sorted(models)}")
    for name, cfg in config.models.items():
        models[name].config = cfg
        models[name].num_replicas = cfg.replicas


def check(
    config: RunConfig,
    models: dict[str, Model],
    trainers: list[Model],
    sync: list[tuple[Model, Model]],
    rollout: FlowGraph,
    evaluation: FlowGraph | None,
) -> None:
    """What the run settings must agree on with the models and flows."""
    cfg = config
    EpisodeSampler(1, cfg.sample_per_episode, cfg.num_samples_per_prompt)  # whole groups per episode
    for m in trainers:
        if not isinstance(m.auto_reduce_grads, bool):
            raise ConfigError(
                f"trainer {m.name!r}: {type(m).__name__}.auto_reduce_grads must be True (flowrl sums the gradients "
                f"over the ranks before each optimizer step) or False (the trainer does), got {m.auto_reduce_grads!r}"
            )
        check_train_sizes(
            global_batch=cfg.global_batch,
            micro_batch=cfg.micro_batch,
            dp=m.config.replicas,
            group=cfg.num_samples_per_prompt,
        )
    if (
        cfg.reproducibility.deterministic or cfg.pipeline.deterministic
    ):  # what it cannot run, refused before anything starts
        key = (
            "RunConfig.reproducibility.deterministic"
            if cfg.reproducibility.deterministic
            else "RunConfig.pipeline.deterministic"
        )
        deterministic = msgspec.structs.replace(cfg.pipeline, deterministic=True)
        for graph in (rollout, evaluation):
            if graph is not None:
                check_deterministic(graph, deterministic, key)
    _check_sync(cfg, trainers, sync, rollout)
    mark_synced(models.values(), sync)  # each replica checks, after setup(), that it can send or load weights
    if cfg.eval_every and evaluation is None:
        raise ConfigError(f"RunConfig.eval_every={cfg.eval_every} but the engine has no eval_flow")
    unknown = sorted({n for g in cfg.colocation for n in g} - models.keys())
    if unknown:
        raise ConfigError(f"RunConfig.colocation names unknown model(s) {unknown}; the models are {sorted(models)}")


def _check_sync(config: RunConfig, trainers: list[Model], sync: list[tuple[Model, Model]], rollout: FlowGraph) -> None:
    for trainer, target in sync:
        if trainer not in trainers or target.name not in rollout.models:
            raise ConfigError(
                f"sync pair ({trainer.name!r} -> {target.name!r}): the first must be a trainer and the "
                "second a model of the rollout flow"
            )
        target.check_weights_from(trainer)
    direct = [t.name for t, _ in sync if t.config.weight_transport != "host"]
    if direct and config.checkpoint.every and config.sync_every > 1:
        raise ConfigError(
            f"trainer(s) {direct} send weights by CUDA IPC or NCCL, which a checkpoint between two syncs cannot "
            f"save (RunConfig.sync_every={config.sync_every} with checkpoint.every={config.checkpoint.every}); set "
            "sync_every=1 or weight_transport='host'"
        )
