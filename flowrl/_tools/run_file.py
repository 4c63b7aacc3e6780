"""``flowrl run CONFIG``: an engine described by a YAML or TOML file.

    flow: rlhf                      # ChatLearn's six-model PPO flow, or "module:function"
    dataset: examples.ppo_tiny:dataset
    models:
      policy: {class: examples.ppo_tiny:Policy, num_replicas: 2, batch_size: 16}
      ...                           # every other key is a ModelConfig key; "args" go to the class
    run: {sample_per_episode: 64, num_episode: 30}   # RunConfig keys

A custom ``flow`` is called as ``flow(prompts, **models)`` and returns the rollout's output,
as a flow function does; ``train`` lists its trainers and ``sync`` its [trainer, model] pairs.
``eval_flow`` (called the same way) and ``eval_dataset`` set the engine's evaluation, which runs
every ``run.eval_every`` episodes.
"""

from __future__ import annotations

import importlib
import sys
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from .._core.config import ModelConfig, to_config
from .._core.errors import ConfigError
from .._core.model import Model
from .._core.run_config import RunConfig, _apply_override, _deep_copy
from .._engine.engine import Engine
from .._engine.rlhf import RLHFEngine

RLHF_ROLES = ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value")


class RunFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    models: dict[str, dict[str, Any]]
    dataset: str
    flow: str = "rlhf"
    train: list[str] = []
    sync: list[list[str]] = []
    relay: str | None = None
    eval_flow: str | None = None
    eval_dataset: str | None = None
    run: dict[str, Any] = {}


def load_run_file(path: str | Path, overrides: Iterable[str] = ()) -> RunFile:
    """The file at ``path`` with ``key.sub=value`` overrides applied, checked."""
    path = Path(path)
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"{path}: expected a .yaml, .yml or .toml file")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    import yaml

    try:
        data: Any = (
            tomllib.loads(path.read_text()) if path.suffix == ".toml" else yaml.safe_load(path.read_text()) or {}
        )
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper()}: {err}") from err
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping with models, dataset and run")
    merged = _deep_copy(data)
    for item in overrides:
        _apply_override(merged, item)
    return to_config(RunFile, merged, str(path))


def resolve(target: str, where: str) -> Any:
    """``module:attribute`` (or ``module.attribute``), imported; the current directory is searched first."""
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    if not module or not attr:
        raise ConfigError(f"{where}: expected module:name, e.g. examples.ppo_tiny:Policy, got {target!r}")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        found = importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"{where}: cannot import module {module!r} ({err})") from err
    try:
        return getattr(found, attr)
    except AttributeError:
        raise ConfigError(f"{where}: module {module!r} has no {attr!r}") from None


def build_models(spec: RunFile) -> dict[str, Model]:
    models: dict[str, Model] = {}
    for name, entry in spec.models.items():
        where = f"models.{name}"
        if not isinstance(entry, Mapping) or "class" not in entry:
            raise ConfigError(f"{where}: expected a mapping with a class, e.g. {{class: examples.ppo_tiny:Policy}}")
        rest = dict(entry)
        cls, args = resolve(rest.pop("class"), f"{where}.class"), rest.pop("args", {})
        if not (isinstance(cls, type) and issubclass(cls, Model)):
            raise ConfigError(f"{where}.class: {entry['class']!r} is not a flowrl.Model subclass")
        if not isinstance(args, Mapping):
            raise ConfigError(f"{where}.args: expected a mapping of keyword arguments, got {type(args).__name__}")
        models[name] = cls(name, to_config(ModelConfig, rest, where), **args)
    return models


def build_engine(spec: RunFile) -> Engine:
    """The engine ``spec`` describes, with its dataset and relay function set."""
    models = build_models(spec)
    config = to_config(RunConfig, spec.run, "run")
    if spec.flow == "rlhf":
        if spec.eval_flow is not None:
            raise ConfigError("eval_flow: give it with a custom flow (module:function), not with flow: rlhf")
        missing = [r for r in RLHF_ROLES if r not in models]
        if missing or len(models) != len(RLHF_ROLES):
            raise ConfigError(f"flow: rlhf needs exactly the models {list(RLHF_ROLES)}; got {sorted(models)}")
        policy, reference, reward, value, ppo_policy, ppo_value = (models[r] for r in RLHF_ROLES)
        engine: Engine = RLHFEngine(policy, reference, reward, value, ppo_policy, ppo_value, config)
    else:
        engine = _custom_engine(spec, models, config)
    items = resolve(spec.dataset, "dataset")
    engine.set_dataset(items() if callable(items) else items)
    if spec.eval_dataset is not None:
        evals = resolve(spec.eval_dataset, "eval_dataset")
        engine.set_eval_dataset(evals() if callable(evals) else evals)
    if spec.relay is not None:
        engine.set_relay_sample_fn(resolve(spec.relay, "relay"))
    return engine


def _custom_engine(spec: RunFile, models: dict[str, Model], config: RunConfig) -> Engine:
    flow = resolve(spec.flow, "flow")
    unknown = sorted({n for n in spec.train if n not in models} | {n for p in spec.sync for n in p if n not in models})
    if unknown:
        raise ConfigError(f"train/sync name unknown model(s) {unknown}; the models are {sorted(models)}")
    if any(len(pair) != 2 for pair in spec.sync):
        raise ConfigError(f"sync: expected [trainer, model] pairs, got {spec.sync}")
    trainers = [models[n] for n in spec.train]
    others = {n: m for n, m in models.items() if m not in trainers}
    evaluate = resolve(spec.eval_flow, "eval_flow") if spec.eval_flow is not None else None
    return Engine(
        rollout=lambda prompts: flow(prompts, **others),
        train=trainers,
        config=config,
        sync=[(models[a], models[b]) for a, b in spec.sync],
        eval_flow=(lambda prompts: evaluate(prompts, **others)) if evaluate is not None else None,
    )
