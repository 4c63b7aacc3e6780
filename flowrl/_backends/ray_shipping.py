"""How a model travels to its Ray replicas: the modules it needs sent by value, and a check,
before any actor starts, that it can be pickled at all."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import ray

from .._core.errors import ConfigError

if TYPE_CHECKING:
    from .._core.flow.model import Model


def ship_by_value(model: Model) -> None:
    """Let replicas unpickle models defined in top-level modules (test files, scripts' helpers).

    Workers do not share the driver's ``sys.path``; a class from a module outside any package
    would not import there, so its module travels by value, as ``__main__`` already does. The
    same holds for what the model holds: a reward function from a script's helper module, given
    to a library model, names that module too.
    """
    held = [v for value in vars(model).values() for v in _shallow(value)]
    for module_name in {cls.__module__ for cls in type(model).__mro__} | {_module_of(v) for v in held}:
        module = sys.modules.get(module_name)
        path = getattr(module, "__file__", None)
        if module is None or not path or module_name == "__main__" or getattr(module, "__package__", None):
            continue  # builtins, __main__ (already by value) and modules inside packages
        if not path.startswith((sys.prefix, sys.base_prefix)):
            ray.cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]  # cloudpickle's is unannotated


def check_picklable(model: Model) -> None:
    """Refuse, before any actor starts, a model Ray could not send to its replicas (a lock, an
    open file or a socket made in ``__init__``); the message names the attribute when one alone fails."""
    err = _pickle_error(model)
    if err is None:
        return
    culprit = next((k for k, v in vars(model).items() if _pickle_error(v) is not None), None)
    what = "it" if culprit is None else f"its attribute {culprit!r} ({type(vars(model)[culprit]).__name__})"
    raise ConfigError(
        f"model {model.name!r} ({type(model).__name__}) cannot be sent to its replicas: {what} cannot be "
        f"pickled ({type(err).__name__}: {err}); build it in setup(), which runs inside each replica"
    ) from err


def _pickle_error(value: Any) -> Exception | None:
    try:
        ray.cloudpickle.dumps(value)  # type: ignore[no-untyped-call]  # cloudpickle's is unannotated
    except Exception as err:  # TypeError, PicklingError, AttributeError... by case
        return err
    return None


def _shallow(value: Any) -> list[Any]:
    """``value``, or the items of a list, tuple or dict (one level: models hold plain containers)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return [*value.keys(), *value.values()]
    return [value]


def _module_of(value: Any) -> str:
    """The module a value's pickle names: a function's or class's own, else its type's."""
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return str(getattr(value, "__module__", "") or "")
    return type(value).__module__
