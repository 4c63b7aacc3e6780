"""``flowrl run CONFIG``: an engine described by a YAML or TOML file.

    flow: rlhf                      # ChatLearn's six-model PPO flow, or "module:function"
    dataset: ppo_tiny:dataset       # module:name, found beside this file first
    models:
      policy: {class: ppo_tiny:Policy, num_replicas: 2, batch_size: 16}
      ...                           # every other key is a ModelConfig key; "args" go to the class
    run: {sample_per_episode: 64, num_episode: 30}   # RunConfig keys

A custom ``flow`` is called as ``flow(prompts, **models)`` and returns the rollout's output,
as a flow function does; ``train`` lists its trainers and ``sync`` its [trainer, model] pairs.
``eval_flow`` (called the same way) and ``eval_dataset`` set the engine's evaluation, which runs
every ``run.eval_every`` episodes.

Import paths are looked up in the run file's folder first, then in the current folder, as a
script's imports are: ``cd examples && flowrl run ppo_tiny.yaml`` and ``flowrl run
examples/ppo_tiny.yaml`` from anywhere name the same modules. ``flowrl run`` keeps the run
file's folder on ``sys.path`` (and ``PYTHONPATH``, for an embedded Ray cluster's replicas) for
the whole run (``run_imports``), so a module a model's ``setup()`` imports from there is found.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, cast

import msgspec

from .._core.errors import ConfigError, FlowError
from .._core.flow.model import Model
from .._core.settings.config import ModelConfig, to_config
from .._core.settings.config_files import apply_override, read_config_file
from .._core.settings.run_config import RunConfig
from .._engine.engine import Engine
from .._engine.rlhf import RLHFEngine

RLHF_ROLES = ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value")


RUN_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$"  # a folder name's part: no separator, no leading dot or dash
RUNS_ROOT = Path("runs")  # where `flowrl run` makes a run's folder by default (in the current folder)


class RunFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    models: dict[str, dict[str, Any]]
    name: Annotated[str, msgspec.Meta(pattern=RUN_NAME)] | None = None  # of the run folder; default: the file's stem
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
    misplaced = sorted(k for k in merged if k in RunConfig.__struct_fields__ and k not in RunFile.__struct_fields__)
    if misplaced:  # `--set run_dir=x` for `--set run.run_dir=x`: say where the key goes
        keys = ", ".join(f"run.{k}" for k in misplaced)
        raise ConfigError(f"{path}: {', '.join(misplaced)} is a run key (RunConfig): give it under run: ({keys})")
    return to_config(RunFile, merged, str(path))


@contextlib.contextmanager
def import_paths(folder: str | Path | None) -> Iterator[None]:
    """``folder`` (a run file's), then the current folder, first on ``sys.path`` inside the block
    only; what was already there stays, what was added is taken out again."""
    wanted = [os.path.abspath(folder)] if folder is not None else []
    wanted.append(os.getcwd())
    added = [p for p in dict.fromkeys(wanted) if p not in sys.path]
    sys.path[0:0] = added
    try:
        yield
    finally:
        for entry in added:
            with contextlib.suppress(ValueError):  # the user's code took it out already
                sys.path.remove(entry)


@contextlib.contextmanager
def run_imports(folder: str | Path) -> Iterator[None]:
    """``folder`` (a run file's) importable for a whole run: first on ``sys.path`` here, and on
    ``PYTHONPATH``, which the processes of a Ray cluster the run starts (an embedded one) inherit;
    both as they were afterwards. A cluster already running (``ray_address``) does not see it."""
    path = os.path.abspath(folder)
    before = os.environ.get("PYTHONPATH")
    parts = before.split(os.pathsep) if before else []
    if path not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([path, *parts])
    try:
        with import_paths(folder):
            yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def resolve(target: object, where: str, folder: str | Path | None = None) -> Any:
    """``module:attribute`` (or ``module.attribute``), imported; ``folder`` (the run file's) is
    searched first, then the current folder."""
    if not isinstance(target, str):
        raise ConfigError(f"{where}: expected module:name, e.g. ppo_tiny:Policy, got {target!r}")
    module, sep, attr = target.partition(":")
    if not sep:
        module, _, attr = target.rpartition(".")
    if not module or not attr:
        raise ConfigError(f"{where}: expected module:name, e.g. ppo_tiny:Policy, got {target!r}")
    try:
        with import_paths(folder):
            found = importlib.import_module(module)
    except ImportError as err:
        looked = _searched(folder)
        raise ConfigError(f"{where}: cannot import module {module!r} ({err}; looked in {looked} first)") from err
    except Exception as err:  # the module's own code failed (or a name like "..x"): the user's, named
        raise ConfigError(f"{where}: importing module {module!r} failed: {type(err).__name__}: {err}") from err
    try:
        return getattr(found, attr)
    except AttributeError:
        raise ConfigError(f"{where}: module {module!r} has no {attr!r}") from None


def _searched(folder: str | Path | None) -> str:
    folders = [os.path.abspath(folder)] if folder is not None else []
    return " and ".join(dict.fromkeys([*folders, os.getcwd()]))


def build_models(spec: RunFile, folder: str | Path | None = None) -> dict[str, Model]:
    models: dict[str, Model] = {}
    for name, entry in spec.models.items():
        where = f"models.{name}"
        if "class" not in entry:
            raise ConfigError(f"{where}: expected a mapping with a class, e.g. {{class: ppo_tiny:Policy}}")
        rest = dict(entry)
        cls, args = resolve(rest.pop("class"), f"{where}.class", folder), rest.pop("args", {})
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


def build_engine(spec: RunFile, folder: str | Path | None = None) -> Engine:
    """The engine ``spec`` describes, with its dataset and relay function set; its import paths
    are looked up in ``folder`` (the run file's) first, then in the current folder."""
    with import_paths(folder):
        return _build_engine(spec, folder)


def _build_engine(spec: RunFile, folder: str | Path | None) -> Engine:
    models = build_models(spec, folder)
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
        engine = _custom_engine(spec, models, config, folder)
    engine.set_dataset(_items(spec.dataset, "dataset", folder))
    if spec.eval_dataset is not None:
        engine.set_eval_dataset(_items(spec.eval_dataset, "eval_dataset", folder))
    if spec.relay is not None:
        engine.set_relay_sample_fn(_function(spec.relay, "relay", folder))
    return engine


def _items(target: str, where: str, folder: str | Path | None) -> list[Any]:
    """The dataset ``target`` names: a sequence (or iterable) of mappings, or a function returning one."""
    found = resolve(target, where, folder)
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


def _function(target: str, where: str, folder: str | Path | None) -> Callable[..., Any]:
    found = resolve(target, where, folder)
    if not callable(found):
        raise ConfigError(f"{where}: {target} is a {type(found).__name__}; expected a function")
    return cast("Callable[..., Any]", found)


def _custom_engine(spec: RunFile, models: dict[str, Model], config: RunConfig, folder: str | Path | None) -> Engine:
    flow = _function(spec.flow, "flow", folder)
    unknown = sorted({n for n in spec.train if n not in models} | {n for p in spec.sync for n in p if n not in models})
    if unknown:
        raise ConfigError(f"train/sync name unknown model(s) {unknown}; the models are {sorted(models)}")
    if any(len(pair) != 2 for pair in spec.sync):
        raise ConfigError(f"sync: expected [trainer, model] pairs, got {spec.sync}")
    trainers = [models[n] for n in spec.train]
    others = {n: m for n, m in models.items() if m not in trainers}
    evaluate = _function(spec.eval_flow, "eval_flow", folder) if spec.eval_flow is not None else None
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


def run_name(spec: RunFile, path: str | Path) -> str:
    """The run's name: the file's ``name`` key, else its stem made fit for a folder name."""
    if spec.name is not None:
        return spec.name
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(path).stem).lstrip(".-")
    return stem[:100] or "run"


def new_run_folder(name: str, root: Path = RUNS_ROOT, now: float | None = None) -> Path:
    """A new folder ``root/<name>-<YYYYmmdd-HHMMSS>`` (local time), made here and now: ``mkdir``
    is atomic, so two runs started in the same second get ``...-HHMMSS`` and ``...-HHMMSS-2``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    try:
        root.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, 1001):
            folder = root / (f"{name}-{stamp}" if attempt == 1 else f"{name}-{stamp}-{attempt}")
            with contextlib.suppress(FileExistsError):
                folder.mkdir()
                return folder
    except OSError as err:
        raise ConfigError(
            f"cannot make a run folder under {str(root)!r} ({err}); give one with --run-dir DIR "
            "(or run.run_dir), or run without one: --no-run-dir"
        ) from err
    raise ConfigError(f"{root}: 1000 run folders named {name}-{stamp}* exist already; give one with --run-dir DIR")
