"""How shard data travels in the Ray backend (with ``ray_backend``).

Shard data rides inside the calls while it is small. An object in Ray's shared memory costs
its reader a trip through the raylet (~2 ms of CPU on 2 cores), and an object Ray pickles
itself costs a few times a no-op call on each side; bytes take Ray's fast path. Input
batches of up to INLINE_BYTES (``approx_nbytes``) stay in the driver and travel sliced per
shard; outputs of up to SMALL_BYTES return inside the call's reply; bigger ones are Batch
objects in shared memory, whose numpy buffers are read zero-copy. Replies are collected by
one thread (``Replies``).
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import threading
import traceback
from typing import TYPE_CHECKING, Any, NoReturn

import msgspec
import ray
import ray.cloudpickle
from ray.cloudpickle import cloudpickle as _cloudpickle
from ray.exceptions import ObjectLostError, OwnerDiedError, RayActorError, RayTaskError

from .._core.errors import (
    FlowError,
    InputLostError,
    PipelineClosedError,
    ReplicaDiedError,
    StageError,
    _shorten,
)
from .._core.flow.batch import approx_nbytes
from .._core.settings.config import CallMeta, Piece, ShardCall, decode_call, encode_message
from .local_channel import RemoteTraceback

if TYPE_CHECKING:
    from .._core.flow.batch import Batch
    from .replica import ReplicaRuntime

INLINE_BYTES = 1 << 20
SMALL_BYTES = 64 << 10
# An inline batch whose pickle is at most this goes whole with a call that reads some of its
# rows (the replica selects them): the driver pickles it once, not a slice per call, and the
# driver is what limits small shards.
WHOLE_BYTES = 16 << 10


class Inline:
    """A small batch kept by the driver in place of an object-store reference: a Batch, or the
    pickle a replica replied with, unpickled only when the driver reads its rows. A shard that
    takes all of its rows forwards the pickle as it came."""

    __slots__ = ("_batch", "blob", "rows")

    def __init__(self, batch: Batch | None = None, *, blob: bytes | None = None, rows: int = 0) -> None:
        self._batch, self.blob = batch, blob
        self.rows = len(batch) if batch is not None else rows

    @property
    def batch(self) -> Batch:
        if self._batch is None:
            assert self.blob is not None  # an Inline is built with a batch or its pickle
            self._batch = pickle.loads(self.blob)
        return self._batch

    def part(self, rows: list[int]) -> tuple[bytes, list[int]]:
        """What a call reading rows ``rows`` of it sends: a pickle, and the rows to read in it.
        The whole pickle while it is small (made once, kept), else the rows alone."""
        if self.blob is None and approx_nbytes(self.batch) <= WHOLE_BYTES:
            self.blob = dumps(self.batch)
        if self.blob is not None and len(self.blob) <= WHOLE_BYTES:
            return self.blob, rows
        if self.blob is not None and len(rows) == self.rows and rows == list(range(self.rows)):
            return self.blob, rows
        return dumps(self.batch.select(rows)), list(range(len(rows)))


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
    that fails for ``__main__`` and the modules sent by value (``ray_shipping.ship_by_value``), so a
    stream naming one of them, or one the C pickler refuses (lambdas, local classes), is
    pickled again by cloudpickle. A false alarm (the name inside a string) only costs time.
    """
    try:
        data = pickle.dumps(obj, protocol=5)
    except (pickle.PicklingError, AttributeError, TypeError):
        return _cloudpickle_dumps(obj)
    by_value_modules = _cloudpickle._PICKLE_BY_VALUE_MODULES
    if b"__main__" in data or any(m.encode() in data for m in by_value_modules):
        return _cloudpickle_dumps(obj)
    return data


def _cloudpickle_dumps(obj: object) -> bytes:
    data: bytes = ray.cloudpickle.dumps(obj)  # type: ignore[no-untyped-call]  # cloudpickle is unannotated
    return data


def frame(head: bytes, body: bytes) -> bytes:
    """A control message and a pickled payload as one bytes object."""
    return len(head).to_bytes(4, "little") + head + body


def unframe(blob: bytes | memoryview) -> tuple[memoryview, memoryview]:
    n = int.from_bytes(blob[:4], "little")
    view = memoryview(blob)
    return view[4 : 4 + n], view[4 + n :]


def local(ref: Inline | Reply) -> Batch:
    return ref.batch if isinstance(ref, Inline) else open_stored(ref.blob)


def open_stored(stored: Any) -> Batch:
    """A shard's output as stored: a reply with the rows inside, or a Batch object."""
    batch: Batch = pickle.loads(unframe(stored)[1]) if isinstance(stored, bytes) else stored
    return batch


def prepare_call(runtime: ReplicaRuntime, blob: bytes, stored: tuple[Any, ...]) -> tuple[ShardCall, Batch, float]:
    """A shard framed by the driver (``call_args``), unpickled and gathered in a replica;
    ``stored`` are the objects its pieces name by index. Runs no user code."""
    head, body = unframe(blob)
    values = [pickle.loads(part) for part in pickle.loads(body)] if body else []

    def fetch(indices: list[int]) -> list[Batch]:
        return [open_stored(stored[i]) if i >= 0 else values[-i - 1] for i in indices]

    call = decode_call(head)
    return (call, *runtime.prepare(call, fetch, private=True))  # unpickled for this call


def answer_reply(meta: CallMeta, out: Batch) -> tuple[bytes, Batch | None]:
    """A shard's reply: with the rows while they are small, else the output to hold."""
    if meta.out_bytes <= SMALL_BYTES:
        return frame(encode_message(meta), dumps(out)), None
    return frame(encode_message(meta), b""), out


def run_call(runtime: ReplicaRuntime, blob: bytes, stored: tuple[Any, ...]) -> tuple[bytes, Batch | None]:
    return answer_reply(*runtime.step(*prepare_call(runtime, blob, stored)))


def error_blob(err: BaseException) -> bytes:
    """A replica's error and its traceback, pickled for the driver (``raise_remote``)."""
    text = "".join(traceback.format_exception(err))
    try:
        return dumps((err, text))
    except Exception:  # an exception that does not pickle still reaches the driver as text
        return dumps((RuntimeError(f"{type(err).__name__}: {err}"), text))


def raise_remote(blob: memoryview, stage: str, replica: int, ids: list[int]) -> NoReturn:
    """Raise a replica's error (``error_blob``) as a StageError, its traceback as the cause."""
    try:
        err, text = pickle.loads(blob)
    except Exception as failure:  # its class does not import here
        err, text = failure, ""
    if not isinstance(err, StageError):
        err = StageError(f"{type(err).__name__}: {err}", stage, replica, ids)
    raise err from RemoteTraceback(text)


def call_args(call: ShardCall) -> tuple[list[Any], bytes, list[Piece]]:
    """The call's object references (each once), the rows it reads from inline batches (each
    piece's rows pickled on its own, a list of them pickled as the call's body), and its pieces
    naming them: index i >= 0 is reference i, -1 - j is inline rows j."""
    refs: list[Any] = []
    parts: list[bytes] = []
    index: dict[Any, int] = {}
    sent: dict[int, int] = {}  # an inline batch sent whole: id -> its part
    pieces = []
    for p in call.pieces:
        if isinstance(p.ref, Inline):
            blob, rows = p.ref.part(p.rows)
            whole = blob is p.ref.blob
            if not whole or id(p.ref) not in sent:
                parts.append(blob)
                if whole:
                    sent[id(p.ref)] = len(parts)
            at = sent[id(p.ref)] if whole else len(parts)
            pieces.append(msgspec.structs.replace(p, ref=-at, rows=rows))
            continue
        ref = p.ref.ref if isinstance(p.ref, Reply) else p.ref
        if ref not in index:
            index[ref] = len(refs)
            refs.append(ref)
        pieces.append(msgspec.structs.replace(p, ref=index[ref]))
    return refs, pickle.dumps(parts, protocol=5) if parts else b"", pieces


# a reply's future and what to settle it with: its value, or the error to raise instead
_Settled = tuple[asyncio.Future[Any], Any, BaseException | None]


class Replies:
    """Replies to the calls in flight, collected by one thread with ``ray.wait``.

    Awaiting each reply's ``ObjectRef`` costs the driver a callback per reply, each taking
    the interpreter lock from the event loop's thread; one ``ray.wait`` collects every reply
    that is ready in one hold of it (on 16 cores a loop of flowrl's calls runs 1.7x faster).
    A call sent while the thread waits on older ones is seen within ``POLL_S``.
    """

    POLL_S = 0.002

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[Any, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def wait(self, ref: Any) -> asyncio.Future[Any]:
        """A future of the loop that calls it, set to the reply's value or its error."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiting[ref] = (loop, future)
            if self._thread is None or not self._thread.is_alive():  # also after a close
                self._thread = threading.Thread(target=self._collect, name="flowrl-replies", daemon=True)
                self._thread.start()
            self._wake.set()
        return future

    def close(self) -> None:
        """Stop the thread; it starts again with the next call."""
        with self._lock:
            self._closed = True
            self._wake.set()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        with self._lock:  # calls still awaited get an error rather than waiting forever
            left, self._waiting = self._waiting, {}
            self._closed = False  # an engine reuses its backend: the next call starts a thread
            self._wake.clear()
        _fail(left, PipelineClosedError("the pipeline closed while this call was in flight"))

    def _collect(self) -> None:
        try:
            self._serve()
        except Exception as err:  # Ray itself failed (shut down, say): nobody may wait forever
            with self._lock:
                left, self._waiting = self._waiting, {}
            _fail(left, err)

    def _serve(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                if self._closed:
                    return
                refs = list(self._waiting)
                if not refs:
                    self._wake.clear()
                    continue
            ready, _ = ray.wait(refs, num_returns=1, timeout=self.POLL_S, fetch_local=False)
            if ready:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
                self._settle(ready)

    def _settle(self, ready: list[Any]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[_Settled]] = {}
        for ref in ready:
            try:
                value, error = ray.get(ref), None
            except Exception as err:  # the call's error, raised where the reply is awaited
                value, error = None, err
            with self._lock:
                loop, future = self._waiting.pop(ref)
            by_loop.setdefault(loop, []).append((future, value, error))
        for loop, settled in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop has closed: nobody awaits
                loop.call_soon_threadsafe(_set_all, settled)


def _fail(left: dict[Any, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]], error: BaseException) -> None:
    for loop, future in left.values():
        settled: list[_Settled] = [(future, None, error)]
        with contextlib.suppress(RuntimeError):  # that loop has closed: nobody awaits
            loop.call_soon_threadsafe(_set_all, settled)


def _set_all(settled: list[_Settled]) -> None:
    for future, value, error in settled:
        if future.done():  # its caller was cancelled
            continue
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)


def translate(err: Exception, stage: str, replica: int, ids: list[int]) -> FlowError:
    """A Ray failure as a FlowError naming the stage, replica and samples; Ray's error chained."""
    if isinstance(err, ObjectLostError):  # Ray's error for a lost argument is both kinds
        where = (
            "the process that owned it exited"
            if isinstance(err, OwnerDiedError)
            else "it was lost with the node that stored it"
        )
        return InputLostError(
            f"stage {stage!r}, replica {replica}, samples {_shorten(ids)}: an input of the shard is gone: {where} "
            f"({type(err).__name__})"
        )
    if isinstance(err, RayTaskError):
        cause = err.cause if isinstance(err.cause, BaseException) else None
        if isinstance(cause, StageError):
            return type(cause)(cause.message, cause.stage, cause.replica, cause.sample_ids)
        return StageError(f"{type(cause or err).__name__}: {cause or err}", stage, replica, ids)
    if isinstance(err, RayActorError):
        return ReplicaDiedError(f"the replica's process died: {err}", stage, replica, ids)
    return StageError(f"{type(err).__name__}: {err}", stage, replica, ids)
