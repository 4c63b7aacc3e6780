"""Argument checks for the public entry points (the error-tree rule of docs/errors.md).

A wrong argument is refused where it enters flowrl, as a ``FlowError`` subclass that says
where (``where``: the call and the argument), what was expected and what was given, instead
of a bare ``TypeError`` or ``AttributeError`` from deep inside the runtime. Each check costs
an ``isinstance`` or two: they run once per call, never per sample.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, Iterable, Mapping, Sized
from numbers import Integral, Real
from pathlib import Path
from typing import Any

from .errors import ConfigError, FlowError


def _kind(value: object) -> str:
    return type(value).__name__


def item_source(value: object, where: str, error: type[FlowError] = ConfigError) -> None:
    """Refuse a source of items that is not a sequence or iterable of them: ``None``, a number,
    a string or a single mapping (one item where several are expected)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (Iterable, AsyncIterable)):
        raise error(
            f"{where}: expected an iterable of items (mappings of field -> value), e.g. [{{'prompt': x}}], "
            f"got {_kind(value)}"
        )


def field_names(value: object, where: str) -> frozenset[str] | None:
    """``value`` as a set of field names (``None`` stays ``None``; one string is one name)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable) or isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected field names (a list of strings), got {_kind(value)}")
    names = frozenset(value)
    bad = sorted((n for n in names if not isinstance(n, str) or not n), key=repr)
    if bad:
        raise ConfigError(f"{where}: field names must be non-empty strings, got {bad}")
    return names


def count(value: object, where: str, *, least: int = 1) -> int:
    """``value`` as an int of at least ``least`` (a bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected an int >= {least}, got {value!r} ({_kind(value)})")
    if value < least:
        raise ConfigError(f"{where}: expected an int >= {least}, got {value}")
    return value


def number(value: object, where: str) -> float:
    """``value`` as a real number (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ConfigError(f"{where}: expected a number, got {value!r} ({_kind(value)})")
    return float(value)


def _per_item(value: object, items: object, where: str, what: str, kind: str) -> list[Any] | None:
    """``value`` as a list of one ``what`` (``kind``: what it must be) per item of ``items``,
    its elements unchecked (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ConfigError(f"{where}: expected a list of {kind}, one per item, got {_kind(value)}")
    if not isinstance(items, Sized):
        raise ConfigError(f"{where}: {what}s need items with a length (a list), got {_kind(items)}")
    out = list(value)
    if len(out) != len(items):
        raise ConfigError(f"{where}: expected one {what} per item ({len(items)}), got {len(out)}")
    return out


def item_costs(value: object, items: object, where: str) -> list[float] | None:
    """``value`` as one finite cost >= 0 per item of ``items`` (``None`` stays ``None``)."""
    given = _per_item(value, items, where, "cost", "numbers")
    if given is None:
        return None
    costs = [number(c, where) for c in given]
    bad = [(i, c) for i, c in enumerate(costs) if not (0.0 <= c < float("inf"))][:3]
    if bad:
        raise ConfigError(f"{where}: costs must be finite numbers >= 0, got {', '.join(f'[{i}]={c}' for i, c in bad)}")
    return costs


def item_ids(value: object, items: object, where: str) -> list[int] | None:
    """``value`` as one distinct sample id >= 0 per item of ``items`` (``None`` stays ``None``)."""
    ids = _per_item(value, items, where, "id", "ints")
    if ids is None:
        return None
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, Integral) or i < 0][:3]
    if bad:
        raise ConfigError(f"{where}: ids must be ints >= 0, got {bad}")
    if len(set(ids)) != len(ids):
        repeated = sorted({i for i in ids if ids.count(i) > 1})[:3]
        raise ConfigError(f"{where}: ids must be distinct; {repeated} repeat")
    return [int(i) for i in ids]


def file_path(value: object, where: str) -> Path:
    """``value`` as a file path (a string or a ``PathLike``)."""
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigError(f"{where}: expected a file path (str or pathlib.Path), got {value!r}")
    return Path(value)


def instance(value: Any, cls: type, where: str, error: type[FlowError] = ConfigError) -> None:
    """Refuse ``value`` unless it is a ``cls``."""
    if not isinstance(value, cls):
        raise error(f"{where}: expected a {cls.__name__}, got {_kind(value)}")
