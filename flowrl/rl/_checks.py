"""Argument checks shared by the estimators and the losses.

Each check raises :class:`~flowrl._core.errors.ConfigError` with a message that names the
function, the argument, what was expected and what was given, so a shape mistake made in a
trainer is reported where it was made rather than as a broadcasting error deep inside torch.
"""

from __future__ import annotations

from numbers import Real
from typing import TYPE_CHECKING

import torch

from .._core.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence


def any_tensor(fn: str, name: str, value: object) -> torch.Tensor:
    """``value`` as a tensor of any shape."""
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def tensor(fn: str, name: str, value: object, ndim: int) -> torch.Tensor:
    """``value`` as a tensor of ``ndim`` dimensions."""
    checked = any_tensor(fn, name, value)
    if checked.dim() != ndim:
        raise ConfigError(f"{fn}: {name} must have {ndim} dimension(s), got shape {tuple(checked.shape)}")
    return checked


def floats(fn: str, name: str, value: object, ndim: int) -> torch.Tensor:
    """``value`` as a floating-point tensor of ``ndim`` dimensions (integer scores are converted)."""
    checked = tensor(fn, name, value, ndim)
    return checked if checked.is_floating_point() else checked.to(torch.get_default_dtype())


def same_shape(fn: str, name: str, value: object, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """``value`` as a tensor with exactly the shape of ``like``."""
    checked = tensor(fn, name, value, like.dim())
    if checked.shape != like.shape:
        raise ConfigError(
            f"{fn}: {name} must have the shape of {like_name} {tuple(like.shape)}, got {tuple(checked.shape)}"
        )
    return checked


def mask_like(fn: str, mask: object, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """The 0/1 ``mask`` checked against ``like`` and cast to its dtype, ready to multiply."""
    return same_shape(fn, "mask", mask, like, like_name).to(like.dtype)


def choice(fn: str, name: str, value: object, allowed: Sequence[str]) -> None:
    """Reject a mode name that is not one of ``allowed``."""
    if value not in allowed:
        names = ", ".join(repr(a) for a in allowed)
        raise ConfigError(f"{fn}: {name} must be one of {names}, got {value!r}")


def number(fn: str, name: str, value: object) -> float:
    """``value`` as a real number; a string, a tensor or ``None`` is refused by name."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ConfigError(f"{fn}: {name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def positive(fn: str, name: str, value: float | None, *, above: float = 0.0) -> None:
    """Reject a number that is not strictly greater than ``above`` (``None`` passes)."""
    if value is not None and not number(fn, name, value) > above:
        raise ConfigError(f"{fn}: {name} must be > {above:g}, got {value!r}")
