"""The run configuration of an RL engine (layer 1), loadable from YAML or TOML with overrides."""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from ._config import ModelConfig, PipelineConfig, _check_types, _non_negative, _positive, check_progress, to_config
from ._errors import ConfigError


class RunConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Episodes, training sizes, relay, sync and evaluation cadence, colocation, per-model configs.

    ``train_global_batch_size`` defaults to ``sample_per_episode`` and
    ``train_micro_batch_size`` to the global batch. ``max_relay_episode``: 0 trains on the
    current episode only, k > 0 keeps the last k episodes, -1 keeps all. ``eval_every``: 0 off.

    Checkpoints: every ``checkpoint_every`` episodes (0: off) into ``checkpoint_dir``, keeping
    the last ``keep_checkpoints`` (0: all). ``resume``: ``"auto"`` continues from the latest
    checkpoint in ``checkpoint_dir`` if there is one, ``"never"`` starts afresh (and refuses a
    folder that holds checkpoints), or the path of one checkpoint folder. A trainer rank that
    dies is rebuilt from the last checkpoint, at most ``max_trainer_restarts`` times in a run.

    ``run_dir``: where the engine writes ``metrics.jsonl`` (a line per episode) and
    ``trace.json`` (the timeline, at the end of every ``learn()``); None writes nothing.
    ``progress``: ``"auto"`` (a live table on a terminal, else a log line per episode on the
    ``flowrl`` logger), ``"live"``, ``"log"`` or ``"off"``.
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
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: str = "auto"
    max_trainer_restarts: int = 3
    run_dir: str | None = None
    progress: str | bool = "auto"  # YAML reads a bare off/on as a bool: False is "off", True "live"
    colocation: list[list[str]] = msgspec.field(default_factory=list)
    models: dict[str, ModelConfig] = msgspec.field(default_factory=dict)
    pipeline: PipelineConfig = msgspec.field(default_factory=PipelineConfig)

    def __post_init__(self) -> None:
        _check_types(self)
        _positive(
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
        _non_negative("RunConfig", eval_every=self.eval_every, checkpoint_every=self.checkpoint_every,
                      keep_checkpoints=self.keep_checkpoints, max_trainer_restarts=self.max_trainer_restarts)
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(
                f"RunConfig.checkpoint_every={self.checkpoint_every} needs RunConfig.checkpoint_dir (the folder "
                "the checkpoints go to)"
            )
        check_progress("RunConfig", self.progress)
        if not self.resume:
            raise ConfigError('RunConfig.resume must be "auto", "never" or the path of a checkpoint folder, got ""')
        if self.max_relay_episode < -1:
            raise ConfigError(
                f"RunConfig.max_relay_episode must be -1 (all), 0 (the current episode only) or > 0, "
                f"got {self.max_relay_episode}"
            )
        seen: dict[str, int] = {}
        for i, group in enumerate(self.colocation):
            for name in group:
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
        path = Path(path)
        if path.suffix not in (".toml", ".yaml", ".yml"):
            raise ConfigError(f"{path}: expected a .yaml, .yml or .toml file")
        text = path.read_text()
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"{path}: expected a .yaml, .yml or .toml file")
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: the top level must be a mapping of RunConfig keys")
        return cls.from_mapping(data, overrides, where=str(path))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], overrides: Iterable[str] = (), where: str = "run config") -> RunConfig:
        merged = _deep_copy(data)
        for item in overrides:
            _apply_override(merged, item)
        return to_config(cls, merged, where)


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def _apply_override(data: dict[str, Any], item: str) -> None:
    """``a.b=c``: the value is read as YAML (numbers, booleans, lists), else kept as text."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. num_episode=4 or models.policy.batch_size=8")
    import yaml

    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    node[leaf] = value
