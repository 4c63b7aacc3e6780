"""Weights between a model and the object store: tensors as numpy arrays that every receiver
reads zero-copy (a dtype numpy lacks travels as its bytes), and back; a synced model's weight
hooks checked at set-up."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._core.errors import StageError
from .._core.flow.model import Model, weight_hooks_problem


def check_weight_hooks(model: Model, replica: int) -> None:
    """A synced model that could not send or receive weights fails now, before episode 0."""
    problem = weight_hooks_problem(model)
    if problem is not None:
        raise StageError(problem, f"{model.name}.setup", replica, [])


def weights_of(model: Model, replica: int) -> dict[str, Any]:
    try:
        return to_arrays(model.get_weights())
    except Exception as err:
        raise StageError(f"{type(err).__name__}: {err}", f"{model.name}.get_weights", replica, []) from err


class Viewed:
    """A tensor of a dtype numpy lacks (bfloat16, float8), sent as its bytes in a numpy array
    of the same width: it still travels zero-copy, never as a pickled tensor."""

    def __init__(self, array: np.ndarray, dtype: str) -> None:
        self.array, self.dtype = array, dtype

    def tensor(self) -> Any:
        torch = sys.modules["torch"]
        return torch.from_numpy(np.array(self.array)).view(getattr(torch, self.dtype))


_SAME_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def to_arrays(weights: Mapping[str, Any]) -> dict[str, Any]:
    """Tensors as numpy arrays, so every receiver reads them zero-copy from the object store."""
    out = {}
    for key, value in weights.items():
        try:
            out[key] = value.detach().cpu().numpy()
        except TypeError:  # a dtype numpy lacks: its bytes, viewed as integers of its width
            torch = sys.modules["torch"]
            plain = value.detach().cpu().view(getattr(torch, _SAME_WIDTH[value.element_size()]))
            out[key] = Viewed(plain.numpy(), str(value.dtype).removeprefix("torch."))
        except (AttributeError, RuntimeError):  # not a tensor
            out[key] = value
    return out


def unviewed(weights: Any) -> Any:
    """``weights`` with the byte arrays of ``to_arrays`` back as tensors (arrays stay arrays)."""
    if not isinstance(weights, Mapping):
        return weights
    return {k: v.tensor() if isinstance(v, Viewed) else v for k, v in weights.items()}


def to_tensors(weights: Mapping[str, Any]) -> dict[str, Any]:
    """Arrays back to tensors for a model that uses torch (one that doesn't keeps numpy)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return dict(weights)
    out = {}
    for k, v in weights.items():
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(np.array(v))
        out[k] = v.tensor() if isinstance(v, Viewed) else v
    return out
