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
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import msgspec

from .._core.config import ModelConfig, to_config
from .._core.config_files import apply_override, read_config_file
from .._core.errors import ConfigError, FlowError
from .._core.model import Model
from .._core.run_config import RunConfig
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
    merged = read_config_file(Path(path), "a mapping with models, dataset and run")
    for item in overrides:
        apply_override(merged, item)
    return to_config(RunFile, merged, str(path))


def resolve(target: object, where: str) -> Any:
    """``module:attribute`` (or ``module.attribute``), imported; the current directory is searched first."""
    if not isinstance(target, str):
        raise ConfigError(f"{where}: expected module:name, e.g. examples.ppo_tiny:Policy, got {target!r}")
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
    except Exception as err:  # the module's own code failed (or a name like "..x"): the user's, named
        raise ConfigError(f"{where}: importing module {module!r} failed: {type(err).__name__}: {err}") from err
    try:
        return getattr(found, attr)
    except AttributeError:
        raise ConfigError(f"{where}: module {module!r} has no {attr!r}") from None


def build_models(spec: RunFile) -> dict[str, Model]:
    models: dict[str, Model] = {}
    for name, entry in spec.models.items():
        where = f"models.{name}"
        if "class" not in entry:
            raise ConfigError(f"{where}: expected a mapping with a class, e.g. {{class: examples.ppo_tiny:Policy}}")
        rest = dict(entry)
        cls, args = resolve(rest.pop("class"), f"{where}.class"), rest.pop("args", {})
        if not (isinstance(cls, type) and issubclass(cls, Model)):
            raise ConfigError(f"{where}.class: {entry['class']!r} is not a flowrl.Model subclass")
        if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
            raise ConfigError(f"{where}.args: expected a mapping of keyword arguments, got {args!r:.200}")
        config = to_config(ModelConfig, rest, where)
        _check_arguments(cls, name, config, args, where)
        try:
            models[name] = cls(name, config, **args)
        except Exception as err:  # the class's own __init__: named, chained
            raise ConfigError(f"{where}: {cls.__name__}(...) failed: {type(err).__name__}: {err}") from err
    return models


def _check_arguments(cls: type[Model], name: str, config: ModelConfig, args: Mapping[str, Any], where: str) -> None:
    """``args`` against the class's constructor, before calling it: an unknown or missing one is named."""
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to check against (a C-level __init__): the call decides
        return
    try:
        signature.bind(name, config, **args)
    except TypeError as err:
        accepted = ", ".join(str(p) for p in list(signature.parameters.values())[2:]) or "none"
        raise ConfigError(
            f"{where}.args: {cls.__name__} refuses {dict(args)!r:.200} ({err}); its arguments besides the name and "
            f"config flowrl passes: {accepted}"
        ) from err


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
    engine.set_dataset(_items(spec.dataset, "dataset"))
    if spec.eval_dataset is not None:
        engine.set_eval_dataset(_items(spec.eval_dataset, "eval_dataset"))
    if spec.relay is not None:
        engine.set_relay_sample_fn(_function(spec.relay, "relay"))
    return engine


def _items(target: str, where: str) -> list[Any]:
    """The dataset ``target`` names: a sequence (or iterable) of mappings, or a function returning one."""
    found = resolve(target, where)
    try:
        items = found() if callable(found) else found
        if isinstance(items, str | bytes | Mapping) or not isinstance(items, Iterable):
            raise ConfigError(
                f"{where}: {target} is a {type(items).__name__}; expected a sequence of mappings, "
                "or a function returning one"
            )
        return list(items)
    except FlowError:
        raise
    except Exception as err:  # the user's dataset function (or iterator) failed: named, chained
        raise ConfigError(f"{where}: building {target} failed: {type(err).__name__}: {err}") from err


def _function(target: str, where: str) -> Callable[..., Any]:
    found = resolve(target, where)
    if not callable(found):
        raise ConfigError(f"{where}: {target} is a {type(found).__name__}; expected a function")
    return cast("Callable[..., Any]", found)


def _custom_engine(spec: RunFile, models: dict[str, Model], config: RunConfig) -> Engine:
    flow = _function(spec.flow, "flow")
    unknown = sorted({n for n in spec.train if n not in models} | {n for p in spec.sync for n in p if n not in models})
    if unknown:
        raise ConfigError(f"train/sync name unknown model(s) {unknown}; the models are {sorted(models)}")
    if any(len(pair) != 2 for pair in spec.sync):
        raise ConfigError(f"sync: expected [trainer, model] pairs, got {spec.sync}")
    trainers = [models[n] for n in spec.train]
    others = {n: m for n, m in models.items() if m not in trainers}
    evaluate = _function(spec.eval_flow, "eval_flow") if spec.eval_flow is not None else None
    for key, function in (("flow", flow), ("eval_flow", evaluate)):
        _takes_the_models(key, getattr(spec, key), function, others)
    return Engine(
        rollout=lambda prompts: flow(prompts, **others),
        train=trainers,
        config=config,
        sync=[(models[a], models[b]) for a, b in spec.sync],
        eval_flow=(lambda prompts: evaluate(prompts, **others)) if evaluate is not None else None,
    )


def _takes_the_models(key: str, target: str, function: Any, models: dict[str, Model]) -> None:
    """``function`` is called as ``function(prompts, **models)``: refuse, before anything runs, one
    that cannot take that call (a flow written for other model names, or no flow at all)."""
    if function is None:
        return
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: the call will tell
        return
    try:
        signature.bind(None, **models)
    except TypeError as err:
        raise ConfigError(
            f"{key}: {target} is called as {key}(prompts, {', '.join(f'{n}=...' for n in models)}) with the models "
            f"that are not trainers, and cannot take that call ({err}); its parameters are {signature}"
        ) from err
