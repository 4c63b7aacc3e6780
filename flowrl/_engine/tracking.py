"""Experiment tracking: after each episode, its scalars go to every logger (TensorBoard, W&B,
MLflow, or any object with the ``Logger`` methods) and its report to every callback.

The scalars are what ``EngineStats`` holds, flattened (``episode_scalars``): the trainers'
metrics (whatever ``train_step`` returns, averaged as in ``EpisodeStats.metrics``) and the
runtime's own (phase seconds, busy fractions, starvation, queues, staleness, episodes/s).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio
import anyio.to_thread
import msgspec

from .._core.errors import ConfigError, FlowError
from .._core.flow.graph import check_one_argument
from .._core.settings.run_config import logger_config
from .engine_stats import EpisodeStats
from .loggers import MLflowLogger, Outcome, TensorBoardLogger, WandbLogger, build, check_installed, check_wandb_login

if TYPE_CHECKING:
    from .._core.observe.pipeline_stats import PipelineStats
    from .._core.settings.run_config import RunConfig
    from .engine_stats import EngineStats, TrainerStats

log = logging.getLogger("flowrl")
PHASES = ("rollout", "train", "sync", "eval", "wait")


@runtime_checkable
class Logger(Protocol):
    """What the engine calls on a logger: ``log_config`` once before the first episode's scalars
    (the run's ``RunConfig`` as plain data), ``log_scalars`` after every episode (``step``: the
    episode's number), ``close`` when the engine stops, however it stops."""

    def log_config(self, config: Mapping[str, Any]) -> None: ...

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class EpisodeReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a callback gets after each episode: its number, the scalars the loggers get, and the
    episode's ``EpisodeStats``."""

    episode: int
    scalars: dict[str, float]
    stats: EpisodeStats


Callback = Callable[[EpisodeReport], object]


def episode_scalars(
    stats: EngineStats, before: EngineStats | None = None, seconds: float | None = None
) -> dict[str, float]:
    """The last episode of ``stats`` as flat scalars. Busy fractions and starvation are the
    episode's own: the counters' growth since ``before`` (the stats after the previous episode;
    None: since the engine started). ``seconds``: the episode's wall time, for episodes/s."""
    last = stats.episodes[-1]
    out = {f"train/{trainer}/{k}": v for trainer, metrics in last.metrics.items() for k, v in metrics.items()}
    out |= {f"time/{p}_s": float(getattr(last, f"{p}_s")) for p in PHASES}
    out |= {f"episode/{k}": float(getattr(last, k)) for k in ("samples", "dropped", "regenerated", "failed")}
    if seconds:
        out["episode/episodes_per_s"] = 1.0 / seconds
    for model, lags in last.staleness.items():
        n = sum(lags.values())
        if n:
            out[f"staleness/{model}/mean"] = sum(lag * count for lag, count in lags.items()) / n
            out[f"staleness/{model}/max"] = float(max(lag for lag, count in lags.items() if count))
    for loop, counts in last.turns.items():
        out[f"turns/{loop}/mean"] = sum(t * n for t, n in counts.items()) / sum(counts.values())
        out[f"turns/{loop}/max"] = float(max(counts))
    out |= {f"weights/{model}/version": float(v) for model, v in last.weight_versions.items()}
    if stats.rollout is not None:
        out |= _rollout_scalars(stats.rollout, before.rollout if before is not None else None)
    out |= _trainer_scalars(stats.trainers, before.trainers if before is not None else {}, last.train_s)
    return out


def _rollout_scalars(now: PipelineStats, before: PipelineStats | None) -> dict[str, float]:
    """Per stage, the busy fraction of its pool while the rollout ran and the queue's peak; per
    model, the seconds its replicas starved (had no shard) and how many serve."""
    active = now.active_s - (before.active_s if before is not None else 0.0)
    out = {"rollout/blocked_s": now.blocked_s - (before.blocked_s if before is not None else 0.0)}
    starved: dict[str, float] = {}
    for name, stage in now.stages.items():
        then = before.stages.get(name) if before is not None else None
        busy = stage.busy_s - (then.busy_s if then is not None else 0.0)
        serving = now.serving.get(stage.model, len(stage.replicas))
        if active > 0 and serving:
            out[f"rollout/{name}/busy"] = max(0.0, busy) / (active * serving)
        out[f"rollout/{name}/queue_peak"] = float(stage.queue_peak)
        # a replica's starvation is its pool's: the same on each of the model's stages
        starved[stage.model] = sum(r.starved_s for r in stage.replicas) - (
            sum(r.starved_s for r in then.replicas) if then is not None else 0.0
        )
    out |= {f"rollout/{model}/starved_s": max(0.0, s) for model, s in starved.items()}
    out |= {f"rollout/{model}/replicas": float(n) for model, n in now.serving.items()}
    return out


def _trainer_scalars(now: dict[str, TrainerStats], before: dict[str, TrainerStats], train_s: float) -> dict[str, float]:
    """Per trainer, the fraction of the train phase its ranks computed, and its steps so far."""
    out: dict[str, float] = {}
    for name, trainer in now.items():
        then = before.get(name)
        busy = sum(r.busy_s for r in trainer.ranks) - (sum(r.busy_s for r in then.ranks) if then else 0.0)
        if train_s > 0 and trainer.ranks:
            # counters restored from a checkpoint (a rebuilt trainer) can be below the last episode's
            out[f"trainer/{name}/busy"] = max(0.0, busy) / (train_s * len(trainer.ranks))
        out[f"trainer/{name}/steps"] = float(trainer.steps)
    return out


def describe(obj: object) -> str:
    """A callback's or logger's name for an error message."""
    name = getattr(obj, "__qualname__", None)
    return name if isinstance(name, str) else f"{type(obj).__name__} object"


def check_loggers(loggers: Sequence[object]) -> list[Logger]:
    if isinstance(loggers, (str, bytes)) or not isinstance(loggers, Sequence):
        raise ConfigError(f"Engine(loggers=...): expected a list of loggers, got {type(loggers).__name__}")
    for i, logger in enumerate(loggers):
        if not isinstance(logger, Logger):
            missing = [m for m in ("log_config", "log_scalars", "close") if not callable(getattr(logger, m, None))]
            raise ConfigError(
                f"Engine(loggers=...)[{i}]: expected a logger (methods log_config, log_scalars, close), "
                f"got {describe(logger)} without {', '.join(missing)}"
            )
    return [logger for logger in loggers if isinstance(logger, Logger)]


def check_callbacks(callbacks: Sequence[Callback]) -> list[Callback]:
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Sequence):
        given = f"the function {describe(callbacks)} (one goes in a list: [fn])" if callable(callbacks) else None
        raise ConfigError(
            f"Engine(callbacks=...): expected a list of functions, got {given or type(callbacks).__name__}"
        )
    for i, fn in enumerate(callbacks):
        check_one_argument(fn, f"Engine(callbacks=...)[{i}]", "the EpisodeReport of an episode")
    return list(callbacks)


class Tracking:
    """The loggers and callbacks of an engine. The loggers ``RunConfig.loggers`` asks for are
    checked when the engine is built (their package installed) and made at the first episode;
    each logger's own files appear only then."""

    def __init__(self, config: RunConfig, loggers: Sequence[object] = (), callbacks: Sequence[Callback] = ()) -> None:
        self.config = config
        self.callbacks = check_callbacks(callbacks)
        self._given = check_loggers(loggers)
        self.specs = [logger_config(item, f"RunConfig.loggers[{i}]") for i, item in enumerate(config.loggers)]
        for i, spec in enumerate(self.specs):
            check_installed(spec, f"RunConfig.loggers[{i}]")
            if spec.kind == "wandb":
                check_wandb_login(spec.mode, f"RunConfig.loggers[{i}]")
        self.loggers: list[Logger] = []
        self._opened = False
        self._before: EngineStats | None = None
        self._mark: float | None = None

    def started(self) -> None:
        """The engine's actors are ready: the first episode's wall time counts from here."""
        self._mark = time.perf_counter()

    async def episode(self, stats: EngineStats) -> EpisodeReport:
        """Log the last episode of ``stats`` and call the callbacks with its report."""
        now = time.perf_counter()
        seconds, self._mark = (now - self._mark if self._mark is not None else None), now
        last = stats.episodes[-1]
        report = EpisodeReport(episode=last.episode, scalars=episode_scalars(stats, self._before, seconds), stats=last)
        self._before = stats
        if self._given or self.specs:
            await anyio.to_thread.run_sync(self._log, report)  # file and network writes off the event loop
        for fn in self.callbacks:
            try:
                fn(report)
            except Exception as err:
                raise FlowError(f"callback {describe(fn)} failed after episode {last.episode}: {err!r}") from err
        return report

    def _log(self, report: EpisodeReport) -> None:
        if not self._opened:
            self._opened = True
            self.loggers = [*self._given, *(build(spec, self.config.run_dir) for spec in self.specs)]
            config = msgspec.to_builtins(self.config)
            for logger in self.loggers:
                _call(logger, "log_config", report.episode, config)
        for logger in self.loggers:
            _call(logger, "log_scalars", report.episode, report.episode, report.scalars)

    async def close(self, *, failing: bool = False) -> None:
        """Close every logger (shielded: also when the run is cancelled). The built-in ones learn
        how the run ended (a failed or cancelled run is not marked finished); a user's logger gets
        a plain ``close()``. A logger that cannot close fails with a FlowError naming it; when the
        run is failing already (``failing``) that is logged instead, so that the run's own error
        is the one raised."""
        outcome = _outcome(failing)
        loggers, self.loggers, self._opened = self.loggers, [], False
        errors: list[FlowError] = []
        with anyio.CancelScope(shield=True):
            for logger in loggers:
                args = (outcome,) if isinstance(logger, BUILT_IN) else ()
                try:
                    await anyio.to_thread.run_sync(_call, logger, "close", None, *args)
                except FlowError as err:
                    errors.append(err)
                    if failing:
                        log.warning("%s", err)
        if errors and not failing:
            raise errors[0]


BUILT_IN = (TensorBoardLogger, WandbLogger, MLflowLogger)


def _outcome(failing: bool) -> Outcome:
    """How the run ended: a failing run whose error in flight is a cancellation (Ctrl-C cancels
    the run's task) was killed, else it failed. The engine closes tracking while that error
    propagates, so it is the one being handled."""
    if not failing:
        return "finished"
    error = sys.exc_info()[1]
    cancelled = (asyncio.CancelledError, KeyboardInterrupt, anyio.get_cancelled_exc_class())
    return "killed" if isinstance(error, cancelled) else "failed"


def _call(logger: Logger, method: str, episode: int | None, *args: Any) -> None:
    """``logger.method(*args)``; what it raises, as a FlowError naming the logger and the episode."""
    try:
        getattr(logger, method)(*args)
    except Exception as err:
        when = f"after episode {episode}" if episode is not None else "when the engine stopped"
        raise FlowError(f"logger {describe(logger)}.{method} failed {when}: {err!r}") from err
