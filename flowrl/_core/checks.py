"""The checks of what a user gives flowrl: the arguments of the public entry points, and the
settings of every config Struct (the error-tree rule of docs/errors.md).

A wrong argument is refused where it enters flowrl, as a ``FlowError`` subclass that says
where (``where``: the call and the argument), what was expected and what was given, instead
of a bare ``TypeError`` or ``AttributeError`` from deep inside the runtime. Each check costs
an ``isinstance`` or two: they run once per call, never per sample.
"""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterable, Collection, Iterable, Mapping, Sized
from decimal import Decimal
from numbers import Integral, Real
from pathlib import Path
from typing import Any, get_args

import msgspec

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


# ---- settings: each config Struct checks its fields with these in ``__post_init__`` ----


def one_of(owner: str, key: str, value: Any, allowed: Any) -> None:
    # msgspec checks Literal fields when decoding, not when a Struct is built in code
    choices = get_args(allowed)
    if value not in choices:
        raise ConfigError(f"{owner}.{key} must be one of {list(choices)}, got {value!r}")


def positive(owner: str, **values: float | None) -> None:
    for key, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{owner}.{key} must be > 0, got {value!r}")


def non_negative(owner: str, **values: float | None) -> None:
    for key, value in values.items():
        if value is not None and value < 0:
            raise ConfigError(f"{owner}.{key} must be >= 0, got {value!r}")


# The runtime keeps counts, ids and sizes in 64-bit integers (numpy arrays, msgpack, Ray): every
# int setting stays within +-2**62 (room for a sum of two), unless its Struct gives it a rule of its own.
INT_LIMIT = 1 << 62


def struct_types(config: msgspec.Struct, *, own_int_range: Collection[str] = ()) -> None:
    """Each field's value against its annotation; every number finite (Decimal, Fraction and
    numpy scalars too, checked before any comparison) and every int, nested sequences included,
    within ``[-INT_LIMIT, INT_LIMIT]`` (the fields in ``own_int_range`` are checked by their
    Struct). msgspec checks a config given as a mapping; one built directly
    (``ModelConfig(batch_size=2.5)``) is checked only here. Every config Struct calls this from
    ``__post_init__``."""
    owner = type(config).__name__
    for field in msgspec.structs.fields(config):
        value = getattr(config, field.name)
        plain = value.item() if type(value).__module__ == "numpy" and hasattr(value, "item") else value  # np.int64(4)
        # numbers first: msgspec itself raises a bare ValueError on a signalling Decimal NaN
        _numbers(f"{owner}.{field.name}", value, ints=field.name not in own_int_range)
        try:
            converted = msgspec.convert(plain, field.type)
        except msgspec.ValidationError as err:
            raise ConfigError(f"{owner}.{field.name}={value!r}: {err}") from None
        if isinstance(value, Decimal):  # msgspec takes a Decimal for a float: kept as the float
            _numbers(f"{owner}.{field.name}", converted)  # Decimal("1e400") is a float inf
            msgspec.structs.force_setattr(config, field.name, converted)
        elif isinstance(converted, msgspec.Struct) and not isinstance(value, msgspec.Struct):
            msgspec.structs.force_setattr(config, field.name, converted)  # a section given as a mapping


def _numbers(where: str, value: Any, *, ints: bool = True) -> None:
    # NaN passes every comparison check (``nan <= 0`` is False; a Decimal NaN raises instead) and
    # inf means "never" only by accident: both are refused wherever a number is set, nested
    # sequences and mappings included. An int beyond INT_LIMIT overflows the runtime's 64-bit counters later.
    if isinstance(value, (list, tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            _numbers(where, item, ints=ints)
    elif isinstance(value, bool):
        return
    elif isinstance(value, Integral):
        if ints and not -INT_LIMIT <= int(value) <= INT_LIMIT:
            raise ConfigError(
                f"{where} must be within [-2**62, 2**62] (the runtime counts in 64-bit integers), got {value!r}"
            )
    elif isinstance(value, (Real, Decimal)) and not _finite(value):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")


def _finite(value: Real | Decimal) -> bool:
    if isinstance(value, Decimal):
        return value.is_finite()
    try:
        return math.isfinite(value)
    except (ValueError, OverflowError):  # a Fraction beyond a float's range
        return False


def at_most(owner: str, bound: float, why: str, **values: float | None) -> None:
    shown = f"{bound:g}" if isinstance(bound, float) else str(bound)
    for key, value in values.items():
        if value is not None and value > bound:
            raise ConfigError(f"{owner}.{key} must be <= {shown} ({why}), got {value!r}")
