"""How shard data travels in the Ray backend (layer 4, with ``_ray_backend``).

Shard data rides inside the calls while it is small. An object in Ray's shared memory costs
its reader a trip through the raylet (~2 ms of CPU on 2 cores), and an object Ray pickles
itself costs a few times a no-op call on each side; bytes take Ray's fast path. Input
batches of up to INLINE_BYTES (``approx_nbytes``) stay in the driver and travel sliced per
shard; outputs of up to SMALL_BYTES return inside the call's reply; bigger ones are Batch
objects in shared memory, whose numpy buffers are read zero-copy.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec
import ray.cloudpickle
from ray.cloudpickle import cloudpickle as _cloudpickle

from ._batch import Batch
from ._config import Piece, ShardCall

INLINE_BYTES = 1 << 20
SMALL_BYTES = 64 << 10


class Inline:
    """A small batch kept by the driver in place of an object-store reference."""

    __slots__ = ("batch",)

    def __init__(self, batch: Batch) -> None:
        self.batch = batch


class Reply:
    """A call's reply holding its rows: the object reference (downstream calls take it as an
    argument, which Ray inlines) and the bytes already in the driver (delivery reads them)."""

    __slots__ = ("ref", "blob")

    def __init__(self, ref: Any, blob: bytes) -> None:
        self.ref, self.blob = ref, blob


def by_value(ref: Any) -> Any:
    return ref.batch if isinstance(ref, Inline) else ref


def dumps(obj: Any) -> bytes:
    """``obj`` pickled for another process of this job, by the C pickler where that is safe.

    cloudpickle consults Python code for every object it writes (~3x the C pickler on a small
    shard). The C pickler names classes and functions by module, which the replica imports;
    that fails for ``__main__`` and the modules sent by value (``_ship_by_value``), so a
    stream naming one of them, or one the C pickler refuses (lambdas, local classes), is
    pickled again by cloudpickle. A false alarm (the name inside a string) only costs time.
    """
    try:
        data = pickle.dumps(obj, protocol=5)
    except (pickle.PicklingError, AttributeError, TypeError):
        return ray.cloudpickle.dumps(obj)
    by_value_modules = _cloudpickle._PICKLE_BY_VALUE_MODULES
    if b"__main__" in data or any(m.encode() in data for m in by_value_modules):
        return ray.cloudpickle.dumps(obj)
    return data


def frame(head: bytes, body: bytes) -> bytes:
    """A control message and a pickled payload as one bytes object."""
    return len(head).to_bytes(4, "little") + head + body


def unframe(blob: bytes) -> tuple[memoryview, memoryview]:
    n = int.from_bytes(blob[:4], "little")
    view = memoryview(blob)
    return view[4 : 4 + n], view[4 + n :]


def local(ref: Inline | Reply) -> Batch:
    return ref.batch if isinstance(ref, Inline) else open_stored(ref.blob)


def open_stored(stored: Any) -> Batch:
    """A shard's output as stored: a reply with the rows inside, or a Batch object."""
    if isinstance(stored, bytes):
        return pickle.loads(unframe(stored)[1])
    return stored


def call_args(call: ShardCall) -> tuple[list[Any], list[Batch], list[Piece]]:
    """The call's object references (each once), the rows of inline batches it reads, and its
    pieces naming them: index i >= 0 is reference i, -1 - j is inline rows j."""
    refs: list[Any] = []
    values: list[Batch] = []
    index: dict[Any, int] = {}
    pieces = []
    for p in call.pieces:
        if isinstance(p.ref, Inline):
            values.append(p.ref.batch.select(p.rows))
            pieces.append(Piece(producer=p.producer, ref=-len(values), rows=list(range(len(p.rows)))))
            continue
        ref = p.ref.ref if isinstance(p.ref, Reply) else p.ref
        if ref not in index:
            index[ref] = len(refs)
            refs.append(ref)
        pieces.append(msgspec.structs.replace(p, ref=index[ref]))
    return refs, values, pieces
