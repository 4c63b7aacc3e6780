"""A column's kind and the field-type rule: what one field of a batch is (a tensor, an array
or a list, its dtype and trailing shape), whatever samples share a shard or an input chunk;
concatenating columns and building them from per-sample values by that rule."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard

import numpy as np

from ..errors import FlowDefinitionError

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    import torch

# torch.Tensor | np.ndarray | list; Any, not that union, so that a step's ``batch["x"] * 2``
# needs no isinstance first.
Column = Any


def is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    # torch is imported lazily: if nobody imported it, nothing here can be a tensor, and a
    # replica that never touches torch starts without paying for its import.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def column_length(value: Column) -> int | None:
    """Rows of a column, or None when the value cannot be a column."""
    if is_tensor(value) or isinstance(value, np.ndarray):
        return int(value.shape[0]) if value.ndim > 0 else None
    if isinstance(value, (list, tuple)):
        return len(value)
    return None


def take_rows(value: Column, rows: np.ndarray) -> Column:
    if is_tensor(value):
        torch = sys.modules["torch"]
        return value[torch.from_numpy(rows).to(value.device)]
    if isinstance(value, np.ndarray):
        return value[rows]
    return [value[i] for i in rows.tolist()]


def copy_column(value: Column) -> Column:
    if is_tensor(value):
        return value.clone()
    return value.copy() if isinstance(value, np.ndarray) else list(value)


# ---- field types: one type per field whatever the shard boundaries (docs/flow-api.md) ----
Signature = tuple[str, str, tuple[int, ...]]  # (kind, dtype, shape); ("list", "", ()) for a list

RAGGED_FIX = "return a list of per-sample tensors for a ragged field, or pad it to a fixed length"
_INPUT_FIX = (
    "write 1.0 rather than 1 in a float field, nan rather than None for a missing number; pad an array "
    "field to one length, or give a ragged one as Python lists (e.g. ids.tolist()), which stay a list"
)
_PY_DTYPES: dict[type, str] = {bool: "bool", int: "int64", float: "float64"}


def _row_signature(value: Any) -> Signature:
    """A value's kind, dtype and whole shape (a column's signature has its trailing shape)."""
    if is_tensor(value):
        return ("tensor", str(value.dtype).removeprefix("torch."), tuple(value.shape))
    if isinstance(value, (np.ndarray, np.generic)):
        return ("array", str(value.dtype), tuple(value.shape))
    return ("list", "", ())


def signature(value: Column) -> Signature:
    """What two parts of one field must share: kind, dtype and trailing shape."""
    kind, dtype, shape = _row_signature(value)
    return (kind, dtype, shape[1:])


COLUMN_KINDS = ("tensor", "array", "list")


def kind_of(value: Column) -> str:
    """``"tensor"``, ``"array"`` or ``"list"``: what a column is."""
    if is_tensor(value):
        return "tensor"
    return "array" if isinstance(value, np.ndarray) else "list"


def describe(sig: Signature) -> str:
    kind, dtype, trailing = sig
    if kind == "list":
        return "a list of per-sample values"
    shape = ", ".join(["n", *map(str, trailing)])
    return f"{_a(dtype)} {'tensor' if kind == 'tensor' else 'numpy array'} of shape [{shape}]"


def _a(word: str) -> str:
    return f"{'an' if word[:1] in tuple('aeiou') else 'a'} {word}"


def drift_message(name: str, source: str, was: Signature, now: Signature, fix: str = RAGGED_FIX) -> str:
    where = f" of {source}" if source else ""
    return (
        f"field {name!r}{where} arrives as {describe(was)} for some samples and as {describe(now)} for others; "
        f"a field keeps one type, dtype and trailing shape for the whole run: {fix}"
    )


def concat_column(name: str, parts: list[Column], source: str) -> Column:
    want = signature(parts[0])
    bad = next((sig for sig in map(signature, parts[1:]) if sig != want), None)
    if bad is not None:
        raise FlowDefinitionError(drift_message(name, source, want, bad))
    if len(parts) == 1:
        return parts[0]
    if want[0] == "tensor":
        return sys.modules["torch"].cat(parts)
    return np.concatenate(parts) if want[0] == "array" else [row for part in parts for row in part]


def like(name: str, value: Column, reference: Column) -> Column:
    """``value``, a new value of field ``name``, as a column of ``reference``'s kind, dtype and
    trailing shape: a loop's state keeps its type whatever a step returns (a list of ints for an
    int64 array). A value that would not convert without loss (floats for ints) is an error."""
    want = signature(reference)
    got = signature(value)
    if got == want:
        return value
    if want[0] == "list":
        return list(value)
    torch = sys.modules.get("torch")
    rows = value.detach().cpu().numpy() if is_tensor(value) else np.asarray(value)
    if rows.dtype == object or not np.can_cast(rows.dtype, want[1] if want[0] == "array" else rows.dtype, "same_kind"):
        raise FlowDefinitionError(
            f"field {name!r} is part of the loop's state, which holds it as {describe(want)}; the step returned "
            f"{describe(got)}, which does not convert to it without loss: return it as the loop's input holds it"
        )
    if tuple(rows.shape[1:]) != want[2]:
        raise FlowDefinitionError(
            f"field {name!r} is part of the loop's state, which holds it as {describe(want)}; the step returned "
            f"rows of shape {list(rows.shape[1:])}: a field keeps its trailing shape"
        )
    if want[0] == "array":
        return rows.astype(want[1], copy=False)
    assert torch is not None  # the reference is a tensor
    out = torch.as_tensor(rows).to(reference.device)
    if not torch.can_cast(out.dtype, reference.dtype):
        raise FlowDefinitionError(
            f"field {name!r} is part of the loop's state, which holds it as {describe(want)}; the step returned "
            f"{describe(got)}, which does not convert to it without loss: return it as the loop's input holds it"
        )
    return out.to(reference.dtype)


def _value_class(value: Any) -> Signature:
    """An input value's class: ("number", dtype, ()), the signature of a tensor or an array
    of one dimension or more, or ("other", "", ())."""
    dtype = _PY_DTYPES.get(type(value))
    if dtype is not None:
        return ("number", dtype, ())
    if isinstance(value, (np.bool_, np.number)) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return ("number", str(value.dtype), ())
    return _row_signature(value) if is_tensor(value) or isinstance(value, np.ndarray) else ("other", "", ())


def per_sample(name: str, values: list[Any], first_item: int) -> Column:
    """One field of input items as a column, by the values' classes, never their neighbours'."""
    if not values:
        return []
    first = _value_class(values[0])
    pos = next((i for i, v in enumerate(values) if _value_class(v) != first), None)
    if pos is not None:
        raise FlowDefinitionError(
            f"field {name!r} of the input items: item {first_item} holds {_shown(first, values[0])}, item "
            f"{first_item + pos} holds {_shown(_value_class(values[pos]), values[pos])}; every item must give "
            f"a field one type, dtype and shape: {_INPUT_FIX}"
        )
    if first[0] == "number":
        try:
            return np.asarray(values, dtype=first[1])
        except OverflowError as err:
            raise FlowDefinitionError(f"field {name!r} of the input items: {err} (an int must fit int64)") from err
    if first[0] == "other":
        return list(values)
    return sys.modules["torch"].stack(values) if first[0] == "tensor" else np.stack(values)


def _shown(cls: Signature, value: Any) -> str:
    kind, dtype, shape = cls
    if kind in ("number", "other"):
        return _a(type(value).__name__) + (f" ({dtype})" if dtype else "")
    return f"{_a(dtype)} {'tensor' if kind == 'tensor' else 'numpy array'} of shape {list(shape)}"


def from_column(name: str, values: list[Any], kind: str) -> Column:
    """Rows of a producer's column (``Sample.kinds``) back into a column of that kind."""
    if kind == "list" or not values:
        return list(values)
    rows = list(dict.fromkeys(map(_row_signature, values)))
    if len(rows) > 1:
        raise FlowDefinitionError(drift_message(name, "", rows[0], rows[1]))
    if rows[0][0] != kind:
        raise FlowDefinitionError(f"field {name!r} was read from a {kind} column but a sample holds {values[0]!r}")
    return sys.modules["torch"].stack(values) if kind == "tensor" else np.stack(values)


def stack_alike(values: list[Any]) -> Column:
    """Values with no column behind them (a dict of yours): stacked when all are tensors (or
    all arrays) of one shape and dtype, an array when all are Python numbers, else a list."""
    rows = set(map(_row_signature, values))
    if len(rows) == 1 and next(iter(rows))[0] != "list":
        return sys.modules["torch"].stack(values) if is_tensor(values[0]) else np.stack(values)
    return np.asarray(values) if all(type(v) in _PY_DTYPES for v in values) else list(values)


class _Columns(Protocol):
    """A batch or a mapping of columns: what ``FieldTypes.check`` reads."""

    def items(self) -> Iterable[tuple[str, Column]]: ...


class FieldTypes:
    """The signature each field had the first time it was seen, checked on every later batch
    of one source (the input items' chunks, one stage's outputs): a field that changes type
    fails where it changes, whatever the shard or chunk boundaries."""

    def __init__(self, source: str, fix: str = RAGGED_FIX) -> None:
        self.source, self.fix = source, fix
        self._seen: dict[str, Signature] = {}

    @classmethod
    def inputs(cls) -> FieldTypes:
        return cls("the input items", _INPUT_FIX)

    def check(self, batch: _Columns) -> None:
        drift = self.drift({name: signature(value) for name, value in batch.items()})
        if drift is not None:
            raise FlowDefinitionError(drift)

    def drift(self, signatures: Mapping[str, Signature]) -> str | None:
        """What changed (a message), or None; ``signatures`` as a replica reports them."""
        for name, sig in signatures.items():
            was = self._seen.setdefault(name, tuple(sig))  # type: ignore[arg-type]
            if was != tuple(sig):
                return drift_message(name, self.source, was, sig, self.fix)
        return None
