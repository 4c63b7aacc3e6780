"""The run configuration of an RL engine, loadable from YAML or TOML with overrides."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ..checks import non_negative, positive, struct_types
from ..errors import ConfigError
from ..names import check_name
from ..training.staleness import SEGMENTS, STALE_POLICIES
from .base import Settings
from .config import ModelConfig, PipelineConfig, check_progress, to_config
from .config_files import apply_override, deep_copy, read_config_file

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

# The keys each logger kind reads besides ``kind`` (``dir``: its folder; wandb's ``mode``: online,
# offline or disabled; mlflow's ``tracking_uri``: a server or store, instead of a local ``dir``).
LOGGER_KEYS: dict[str, tuple[str, ...]] = {
    "tensorboard": ("dir",),
    "wandb": ("dir", "project", "name", "mode"),
    "mlflow": ("dir", "tracking_uri", "experiment", "name"),
}
WANDB_MODES = ("online", "offline", "disabled")


class LoggerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """One experiment tracker the engine writes each episode's scalars to (``RunConfig.loggers``).

    ``kind``: ``"tensorboard"``, ``"wandb"`` or ``"mlflow"``. ``dir``: its folder (default inside
    ``RunConfig.run_dir``, else ``runs/``). wandb: ``project``, ``name`` (the run's), ``mode``
    (``"offline"`` never touches the network). mlflow: ``tracking_uri`` (a server or store; else a
    local file store in ``dir``), ``experiment``, ``name`` (the run's). A key the kind does not read
    is refused.
    """

    kind: str
    dir: str | None = None
    project: str | None = None
    name: str | None = None
    mode: str | None = None
    tracking_uri: str | None = None
    experiment: str | None = None

    def __post_init__(self) -> None:
        struct_types(self)
        if self.kind not in LOGGER_KEYS:
            raise ConfigError(f"LoggerConfig.kind must be one of {list(LOGGER_KEYS)}, got {self.kind!r}")
        reads = LOGGER_KEYS[self.kind]
        extra = [f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__[1:] if f not in reads]
        extra = [e for e in extra if not e.endswith("=None")]
        if extra:
            raise ConfigError(
                f"LoggerConfig(kind={self.kind!r}) reads the keys {', '.join(reads)}; "
                f"it does not read {', '.join(extra)}"
            )
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ConfigError(f"LoggerConfig.mode (wandb) must be one of {list(WANDB_MODES)}, got {self.mode!r}")
        if self.dir is not None and self.tracking_uri is not None:
            raise ConfigError(
                f"LoggerConfig(kind='mlflow'): give dir (a local file store) or tracking_uri, not both "
                f"(got dir={self.dir!r}, tracking_uri={self.tracking_uri!r})"
            )
        for key in ("dir", "tracking_uri", "project", "name", "experiment"):
            value = getattr(self, key)
            if value is not None and (not value or "\x00" in value):
                raise ConfigError(f"LoggerConfig.{key} must be a non-empty string without NUL, got {value!r}")


def logger_config(item: str | LoggerConfig | Mapping[str, Any], where: str) -> LoggerConfig:
    """An entry of ``RunConfig.loggers`` (a kind's name, a mapping or a ``LoggerConfig``) as a ``LoggerConfig``."""
    if isinstance(item, str):
        return LoggerConfig(kind=item)
    return to_config(LoggerConfig, item, where)


def _path_without_nul(owner: str, **paths: str | None) -> None:
    for key, path in paths.items():
        if isinstance(path, str) and "\x00" in path:  # the OS refuses it, with a bare ValueError, only later
            raise ConfigError(f"{owner}.{key} is a path and cannot hold a NUL character (\\x00), got {path!r}")


class CheckpointConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """``RunConfig.checkpoint``: a checkpoint every ``every`` episodes (0: none) into ``dir``,
    keeping the last ``keep`` (0: all). ``resume``: ``"auto"`` continues from the latest
    checkpoint in ``dir`` if there is one, ``"never"`` starts afresh (and refuses a folder that
    holds checkpoints), or the path of one checkpoint folder. A trainer rank that dies is rebuilt,
    at most ``max_trainer_restarts`` times in a run: with ``rebuild_from_survivor``, from a
    surviving rank's state where the group can continue (several ranks whose gradients flowrl sums,
    nothing sharded, no gradient sum of the broken step completed), the broken step run again;
    else from the last checkpoint, the episodes since run again."""

    dir: str | None = None
    every: int = 0
    keep: int = 2
    resume: str = "auto"
    max_trainer_restarts: int = 3
    rebuild_from_survivor: bool = True

    def __post_init__(self) -> None:
        struct_types(self)
        where = "RunConfig.checkpoint"
        non_negative(where, every=self.every, keep=self.keep, max_trainer_restarts=self.max_trainer_restarts)
        _path_without_nul(where, dir=self.dir, resume=self.resume)
        if self.every and not self.dir:
            raise ConfigError(
                f"RunConfig.checkpoint.every={self.every} needs RunConfig.checkpoint.dir (the folder the "
                "checkpoints go to)"
            )
        if not self.resume:
            raise ConfigError(
                'RunConfig.checkpoint.resume must be "auto", "never" or the path of a checkpoint folder, got ""'
            )


class StalenessConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """``RunConfig.staleness``, asynchronous training: ``max`` k > 0 lets the rollout of later
    episodes run while earlier ones train, every trained sample generated by weights at most k
    versions old (0: synchronous). ``on_stale``: ``"wait"`` admits an episode's prompts only once
    the bound can be met; ``"drop"`` and ``"regenerate"`` start each rollout one version earlier
    and drop, or generate again, the samples that end up more than k versions behind. A sample
    generated in segments (a partial rollout: a loop whose body calls a synced model) counts as
    generated by its oldest segment's weights, or by its newest's (``segment``)."""

    max: int = 0
    on_stale: str = "wait"
    segment: str = "oldest"

    def __post_init__(self) -> None:
        struct_types(self)
        non_negative("RunConfig.staleness", max=self.max)
        if self.on_stale not in STALE_POLICIES:
            raise ConfigError(
                f"RunConfig.staleness.on_stale must be one of {list(STALE_POLICIES)}, got {self.on_stale!r}"
            )
        if self.segment not in SEGMENTS:
            raise ConfigError(f"RunConfig.staleness.segment must be one of {list(SEGMENTS)}, got {self.segment!r}")

    @property
    def overlaps(self) -> bool:
        """Whether rollouts run ahead of training (``max`` > 0, or a drop/regenerate policy)."""
        return self.max > 0 or self.on_stale != "wait"


class ReproducibilityConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """``RunConfig.reproducibility`` (docs/reproducibility.md): ``deterministic`` turns on
    torch's deterministic algorithms in every replica and trainer and cuts every shard as a fixed
    block of sample ids (``PipelineConfig.deterministic``), so a sample's numbers do not depend on
    which samples shared its forward pass. ``record_schedule``: a file the engine writes, per
    episode, the weight version each rollout sample was generated with (what timing decides in
    asynchronous training); ``replay_schedule``: such a file, read back so that every sample is
    generated with the version it had in the recorded run."""

    deterministic: bool = False
    record_schedule: str | None = None
    replay_schedule: str | None = None

    def __post_init__(self) -> None:
        struct_types(self)
        _path_without_nul(
            "RunConfig.reproducibility", record_schedule=self.record_schedule, replay_schedule=self.replay_schedule
        )


class RunConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """Episodes, training sizes, relay, sync and evaluation cadence, colocation, per-model configs.

    ``train_global_batch_size`` defaults to ``sample_per_episode`` and
    ``train_micro_batch_size`` to the global batch. ``max_relay_episode``: 0 trains on the
    current episode only, k > 0 keeps the last k episodes, -1 keeps all. ``eval_every``: 0 off.

    ``checkpoint``, ``staleness`` and ``reproducibility``: sections of their own (``CheckpointConfig``,
    ``StalenessConfig``, ``ReproducibilityConfig``).

    ``run_dir``: where the engine writes ``metrics.jsonl`` (a line per episode) and
    ``trace.json`` (the timeline, at the end of every ``learn()``); None writes nothing.
    ``progress``: ``"auto"`` (a live table on a terminal, else a log line per episode on the
    ``flowrl`` logger), ``"live"``, ``"log"`` or ``"off"``. ``loggers``: experiment trackers that
    get each episode's scalars (``"tensorboard"``, ``"wandb"``, ``"mlflow"`` or a ``LoggerConfig``).

    Length-aware scheduling: ``length_field`` names an output field of the rollout holding each
    sample's response length (a number, or a sequence of token ids whose ``len()`` is used, e.g.
    ``"response_ids"``). The engine remembers it per prompt (dataset item) across episodes and
    epochs (checkpoints keep it), and each later rollout starts the longest predicted samples
    first and groups samples of similar predicted length in a shard. None: nothing remembered
    (an ``Engine(predict_cost=...)`` hook may still predict).
    """

    sample_per_episode: int
    num_episode: int = 1
    train_global_batch_size: int | None = None
    train_micro_batch_size: int | None = None
    num_training_epoch: int = 1
    max_relay_episode: int = 0
    sync_every: int = 1
    eval_every: int = 0
    seed: int = 0
    collective_timeout_s: float = 600.0
    shuffle: bool = False
    num_samples_per_prompt: int = 1
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    staleness: StalenessConfig = msgspec.field(default_factory=StalenessConfig)
    reproducibility: ReproducibilityConfig = msgspec.field(default_factory=ReproducibilityConfig)
    length_field: str | None = None
    run_dir: str | None = None
    progress: str | bool = "auto"  # YAML reads a bare off/on as a bool: False is "off", True "live"
    loggers: list[str | LoggerConfig] = msgspec.field(default_factory=list)  # each a LoggerConfig after __post_init__
    colocation: list[list[str]] = msgspec.field(default_factory=list)
    models: dict[str, ModelConfig] = msgspec.field(default_factory=dict)
    pipeline: PipelineConfig = msgspec.field(default_factory=PipelineConfig)

    # keys that moved into a section on 2026-12-06: an old run file or call is told where each went
    moved_keys = {
        "checkpoint_dir": "checkpoint.dir",
        "checkpoint_every": "checkpoint.every",
        "keep_checkpoints": "checkpoint.keep",
        "resume": "checkpoint.resume",
        "max_trainer_restarts": "checkpoint.max_trainer_restarts",
        "max_staleness": "staleness.max",
        "on_stale": "staleness.on_stale",
        "stale_segment": "staleness.segment",
        "deterministic": "reproducibility.deterministic",
        "record_schedule": "reproducibility.record_schedule",
        "replay_schedule": "reproducibility.replay_schedule",
    }

    def __post_init__(self) -> None:
        struct_types(self)
        positive(
            "RunConfig",
            sample_per_episode=self.sample_per_episode,
            num_episode=self.num_episode,
            train_global_batch_size=self.train_global_batch_size,
            train_micro_batch_size=self.train_micro_batch_size,
            num_training_epoch=self.num_training_epoch,
            sync_every=self.sync_every,
            num_samples_per_prompt=self.num_samples_per_prompt,
            collective_timeout_s=self.collective_timeout_s,
        )
        non_negative(
            "RunConfig",
            eval_every=self.eval_every,
            seed=self.seed,  # numpy's generators take no negative seed: refused here, not at the first shuffle
        )
        _path_without_nul("RunConfig", run_dir=self.run_dir)
        check_progress("RunConfig", self.progress)
        if self.length_field is not None and not self.length_field:
            raise ConfigError(
                "RunConfig.length_field must name an output field (e.g. 'response_ids') or be None, got ''"
            )
        loggers = [logger_config(item, f"RunConfig.loggers[{i}]") for i, item in enumerate(self.loggers)]
        msgspec.structs.force_setattr(self, "loggers", loggers)  # "tensorboard" and {kind: ...} alike
        if self.max_relay_episode < -1:
            raise ConfigError(
                f"RunConfig.max_relay_episode must be -1 (all), 0 (the current episode only) or > 0, "
                f"got {self.max_relay_episode}"
            )
        for name in self.models:
            check_name(name, "RunConfig.models")
        seen: dict[str, int] = {}
        for i, group in enumerate(self.colocation):
            for name in group:
                check_name(name, f"RunConfig.colocation[{i}]")
                if name in seen:
                    raise ConfigError(f"RunConfig.colocation: model {name!r} is in groups {seen[name]} and {i}")
                seen[name] = i

    @property
    def global_batch(self) -> int:
        return self.train_global_batch_size or self.sample_per_episode

    @property
    def micro_batch(self) -> int:
        return self.train_micro_batch_size or self.global_batch

    @classmethod
    def load(cls, path: str | Path, overrides: Iterable[str] = ()) -> RunConfig:
        """Read a ``.yaml``/``.yml``/``.toml`` file, then apply ``key.sub=value`` overrides."""
        data = read_config_file(Path(path), "a mapping of RunConfig keys")
        return cls.from_mapping(data, overrides, where=str(path))

    @classmethod
    def from_mapping(
        cls, data: Mapping[str, Any], overrides: Iterable[str] = (), where: str = "run config"
    ) -> RunConfig:
        merged = deep_copy(data)
        for item in overrides:
            apply_override(merged, item)
        return to_config(cls, merged, where)
