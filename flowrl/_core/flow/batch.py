"""Columnar samples: ``ids`` plus field -> tensor (dim 0 = sample), array or list."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..errors import FlowDefinitionError, FlowError, MissingFieldError
from .columns import (
    RAGGED_FIX,
    Column,
    column_length,
    concat_column,
    copy_column,
    from_column,
    is_tensor,
    kind_of,
    per_sample,
    stack_alike,
    take_rows,
)
from .streams import numpy_generators, row_seeds, torch_generators


def approx_nbytes(batch: Batch) -> int:
    """About how many bytes of data ``batch`` holds (what it pickles to, less the framing)."""
    total = batch.ids.nbytes
    for value in batch._fields.values():
        nbytes = _nbytes(value)
        if nbytes is None:  # a list column: its items' sizes
            nbytes = sum(_nbytes(v) or (len(v) if isinstance(v, (str, bytes)) else 16) for v in value)
        total += nbytes
    return total


def _nbytes(value: Any) -> int | None:
    if is_tensor(value):
        return value.element_size() * value.numel()
    return value.nbytes if isinstance(value, np.ndarray) else None


SMALL_ARRAY = 64 << 10  # bytes; a smaller array pickles as its raw bytes

# ("raw" | "torch", array) or ("raw" | "torch", dtype, shape, bytes): see _pack
_Packed = tuple[Any, ...]


def _encode(value: Column) -> _Packed:
    # numpy buffers are read zero-copy from Ray's shared memory; torch tensors are pickled.
    if is_tensor(value) and value.device.type == "cpu":
        try:
            return _pack("torch", value.detach().numpy())
        except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16), conjugate views
            return ("raw", value)
    return _pack("raw", value) if type(value) is np.ndarray else ("raw", value)


def _pack(kind: str, array: np.ndarray) -> _Packed:
    # numpy's own pickling costs ~10 us an array, most of a small shard's cost; a big array
    # keeps it, for pickle 5's out-of-band buffers (zero-copy reads from shared memory).
    if array.nbytes <= SMALL_ARRAY and array.dtype.fields is None and not array.dtype.hasobject:
        return (kind, array.dtype.str, array.shape, array.tobytes())
    return (kind, array)


def _decode(tagged: _Packed) -> Column:
    if len(tagged) == 4:
        kind, dtype, shape, data = tagged
        value = np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)  # writable, as unpickled
    else:
        kind, value = tagged
    if kind == "torch":
        import torch

        # Object-store buffers are read-only; the tensor shares them (zero-copy), so a stage
        # must treat its inputs as read-only, as it would any field it did not write.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(value)
    return value


def _rebuild(ids: _Packed, fields: dict[str, _Packed]) -> Batch:
    batch = Batch.__new__(Batch)  # the pickled ids are int64 and flat already: no checks
    batch.ids = _decode(ids)
    batch._fields = {k: _decode(v) for k, v in fields.items()}
    batch._stream = None  # a step's input gets its streams from the runtime, not from the pickle
    return batch


def _id_array(values: object, where: str) -> np.ndarray:
    """Sample ids or row numbers as a flat int64 array."""
    try:
        return np.asarray(values, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError) as err:
        raise FlowDefinitionError(f"{where}: expected a sequence of ints, got {values!r}") from err


class Stream(NamedTuple):
    """What a step's input derives its samples' random streams from (``Batch.seeds``)."""

    seed: int
    stage: str
    turns: dict[int, int] | None  # sample id -> its turn of the stage's loop (None: not in a loop)


class Batch:
    """Several samples as columns. ``len(batch)`` is the number of samples.

    Reading is dict-like (``batch["query"]``, ``"query" in batch``, ``batch.keys()``).
    Assigning a *new* field is allowed (ChatLearn style: ``data["out"] = x; return data``);
    assigning an existing field is an error, because a stage never overwrites a field.
    """

    __slots__ = ("ids", "_fields", "_kinds", "_stream")

    def __init__(
        self, ids: Sequence[int] | np.ndarray, fields: Mapping[str, Column] | None = None, *, _check: bool = True
    ) -> None:
        self.ids = _id_array(ids, "Batch(ids=...)")
        self._stream: Stream | None = None  # set by the runtime for a step's input
        self._fields: dict[str, Column] = {}
        if _check and fields is not None and not isinstance(fields, Mapping):
            raise FlowDefinitionError(
                f"Batch(fields=...): expected a mapping of field -> column, got {type(fields).__name__}"
            )
        for name, value in (fields or {}).items():
            if _check:
                self._check_column(name, value)
            self._fields[name] = value

    # ---- construction ----
    @classmethod
    def from_samples(cls, ids: Sequence[int], samples: Sequence[Mapping[str, Any]]) -> Batch:
        """Per-sample values as columns. A field of ``Sample``s read from a producer's column
        gets that column's kind back (a list stays a list; a tensor or array is stacked, and
        rows of different shapes or dtypes are an error); any other field is stacked when its
        values are tensors (or arrays) of one shape and dtype, an array when they are Python
        numbers, a list otherwise."""
        names = cls._sample_names(ids, samples)
        kinds = _kinds_of(samples)
        return cls(
            ids,
            {
                n: from_column(n, values, kinds[n]) if n in kinds else stack_alike(values)
                for n, values in ((n, [s[n] for s in samples]) for n in names)
            },
        )

    @classmethod
    def from_items(cls, ids: Sequence[int], items: Sequence[Mapping[str, Any]], *, first_item: int = 0) -> Batch:
        """Input items as columns, by a rule that keeps a field's type whatever the chunk
        boundaries: numbers (Python or numpy, one dtype per field) -> a 1-D array, tensors
        (arrays) of one shape and dtype -> stacked, anything else (strings, lists, objects) ->
        a list of per-item values; a field that mixes these is an error."""
        names = cls._sample_names(ids, items)
        return cls(ids, {n: per_sample(n, [s[n] for s in items], first_item) for n in names})

    @staticmethod
    def _sample_names(ids: Sequence[int], samples: Sequence[Mapping[str, Any]]) -> list[str]:
        if len(ids) != len(samples):
            raise FlowError(f"Batch.from_samples: {len(ids)} ids for {len(samples)} samples")
        names = list(samples[0].keys()) if samples else []
        for pos, sample in enumerate(samples):
            if set(sample.keys()) != set(names):
                raise FlowDefinitionError(
                    f"sample {ids[pos]} has fields {sorted(sample)}, sample {ids[0]} has {sorted(names)}; "
                    "every sample must have the same fields"
                )
        return names

    @staticmethod
    def concat(batches: Sequence[Batch], *, source: str = "") -> Batch:
        """The rows of ``batches`` in order. Each field keeps its kind: lists join into a list,
        tensors (arrays) of one dtype and trailing shape into one tensor (array); parts of
        different kinds, dtypes or trailing shapes are an error naming the field (and
        ``source``, the stage that produced it, when given)."""
        if not batches:
            return Batch([])
        bad = next((b for b in batches if not isinstance(b, Batch)), None)
        if bad is not None:
            raise FlowDefinitionError(
                f"Batch.concat: expected a list of Batches, got a {type(bad).__name__} among them"
            )
        names = batches[0].keys()
        for b in batches[1:]:
            if b.keys() != names:
                raise FlowError(f"cannot concatenate batches with fields {sorted(names)} and {sorted(b.keys())}")
        ids = np.concatenate([b.ids for b in batches])
        return Batch(ids, {n: concat_column(n, [b._fields[n] for b in batches], source) for n in names}, _check=False)

    def kinds(self) -> dict[str, str]:
        """Field -> ``"list"``, ``"tensor"`` or ``"array"``: what a ``Sample`` read from one of
        these rows remembers, so that ``from_samples`` rebuilds each column as it was."""
        kinds: dict[str, str] | None = getattr(self, "_kinds", None)  # asked once per delivered sample
        if kinds is None or len(kinds) != len(self._fields):  # fields are only ever added
            kinds = self._kinds = {n: kind_of(v) for n, v in self._fields.items()}
        return kinds

    # ---- mapping-like reads ----
    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, name: str) -> Column:
        try:
            return self._fields[name]
        except KeyError:
            raise MissingFieldError(f"field {name!r} is not in this batch; it has {sorted(self._fields)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._fields

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def keys(self) -> set[str]:
        return set(self._fields)

    def items(self) -> Iterable[tuple[str, Column]]:
        return self._fields.items()

    def get(self, name: str, default: Any = None) -> Any:
        return self._fields.get(name, default)

    def __setitem__(self, name: str, value: Column) -> None:
        if name in self._fields:
            raise FlowError(
                f"field {name!r} already exists in this batch; a stage adds fields, it never overwrites one"
            )
        self._check_column(name, value)
        self._fields[name] = value

    # ---- row operations ----
    def select(self, rows: Sequence[int] | np.ndarray) -> Batch:
        idx = _id_array(rows, "Batch.select(rows)")
        try:
            ids = self.ids[idx]
        except IndexError as err:  # checked here, not before: the valid path costs nothing more
            raise FlowDefinitionError(
                f"Batch.select: rows {idx.tolist()} out of range for {len(self)} samples"
            ) from err
        return self._keep_stream(Batch(ids, {n: take_rows(v, idx) for n, v in self._fields.items()}, _check=False))

    def only(self, names: Sequence[str]) -> Batch:
        """The same rows with fields ``names`` only (a view: the columns are shared)."""
        return self._keep_stream(Batch(self.ids, {n: self[n] for n in names}, _check=False))

    def merge(self, other: Batch) -> Batch:
        """The union of two batches' fields for the same samples in the same order."""
        if not isinstance(other, Batch):
            raise FlowDefinitionError(f"Batch.merge: expected a Batch, got {type(other).__name__}")
        # ids are always flat int64: comparing their bytes is ~10x cheaper than array_equal
        if self.ids is not other.ids and self.ids.tobytes() != other.ids.tobytes():
            raise FlowError(f"cannot merge batches of different samples: {self.ids.tolist()} vs {other.ids.tolist()}")
        both = self.keys() & other.keys()
        if both:
            raise FlowError(f"cannot merge batches that both have fields {sorted(both)}")
        return self._keep_stream(Batch(self.ids, {**self._fields, **other._fields}, _check=False))

    def copy(self) -> Batch:
        """The same rows in columns of its own (a list column's items are shared): what a
        step returned, kept after the step although the model may reuse its buffers."""
        return Batch(self.ids.copy(), {n: copy_column(v) for n, v in self._fields.items()}, _check=False)

    # ---- per-sample random streams (streams.py) ----
    def seeds(self) -> np.ndarray:
        """A 64-bit seed per sample (uint64), from the run's seed (``RunConfig.seed``, or
        ``PipelineConfig.seed``), the stage, the sample's id and its turn in a loop: the same
        for a sample on any replica, in any shard, in process and on Ray. A batch not handed
        to a step by flowrl derives them from seed 0 and its ids."""
        seed, stage, turns = self._stream or Stream(0, "", None)
        return row_seeds(seed, stage, self.ids, None if turns is None else [turns[int(i)] for i in self.ids])

    def generators(self, device: Any = None) -> list[Any]:
        """A ``torch.Generator`` per sample (on ``device``, the CPU by default), seeded from
        ``seeds()``: draw each sample's randomness from its own (e.g. ``flowrl.rl.sample_rows``).
        Each call starts the streams again: make them once per step."""
        return torch_generators(self.seeds(), device)

    def rngs(self) -> list[np.random.Generator]:
        """A numpy ``Generator`` per sample, seeded from ``seeds()`` (see ``generators``)."""
        return numpy_generators(self.seeds())

    def _keep_stream(self, other: Batch) -> Batch:
        other._stream = self._stream  # a subset of the same samples: the same streams
        return other

    def row(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise FlowDefinitionError(f"Batch.row({i}): out of range for {len(self)} samples")
        return {n: v[i] for n, v in self._fields.items()}

    def __reduce__(self) -> tuple[Callable[[_Packed, dict[str, _Packed]], Batch], tuple[_Packed, dict[str, _Packed]]]:
        return (_rebuild, (_pack("raw", self.ids), {k: _encode(v) for k, v in self._fields.items()}))

    def __repr__(self) -> str:
        return f"Batch(samples={len(self)}, fields={sorted(self._fields)})"

    def _check_column(self, name: str, value: Column) -> None:
        got = column_length(value)
        if got != len(self):
            shape = getattr(value, "shape", None)
            what = (
                f"length {got}"
                if got is not None
                else f"a {type(value).__name__}{'' if shape is None else f' of shape {tuple(shape)}'}"
            )
            raise FlowError(f"field {name!r} must have {len(self)} rows (one per sample), got {what}")


class Sample(Mapping[str, Any]):
    """One finished sample: its ``id`` (dataset order within the pipeline) and its fields.

    ``kinds``: field -> the kind of the column it was read from (``Batch.kinds``), so that a
    batch rebuilt from samples (a trainer's) has each field's type whatever samples it holds."""

    __slots__ = ("id", "_fields", "kinds")

    def __init__(self, sample_id: int, fields: dict[str, Any], kinds: Mapping[str, str] | None = None) -> None:
        self.id = sample_id
        self._fields = fields
        self.kinds: Mapping[str, str] = kinds if kinds is not None else {}

    def __getitem__(self, name: str) -> Any:
        try:
            return self._fields[name]
        except KeyError:
            raise MissingFieldError(f"sample {self.id} has no field {name!r}; it has {sorted(self._fields)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"Sample(id={self.id}, fields={sorted(self._fields)})"


def _kinds_of(samples: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The column kind of each field that ``Sample``s remember; samples that disagree (a
    stage returned a list in one shard and a tensor in another) are an error."""
    kinds: dict[str, str] = {}
    for s in samples:
        for name, kind in getattr(s, "kinds", {}).items():
            was = kinds.setdefault(name, kind)
            if was != kind:
                raise FlowDefinitionError(
                    f"field {name!r} was returned as a {was} for some samples and as a {kind} for others "
                    f"(sample {getattr(s, 'id', '?')}); a field keeps one type for the whole run: {RAGGED_FIX}"
                )
    return kinds
