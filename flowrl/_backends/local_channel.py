"""A channel per replica on the driver's node (for the Ray backend; no ray import).

A Ray actor call costs both sides far more CPU than its bytes do (on 2 cores a no-op call
takes ~1.6 ms of CPU, submission alone 0.3-0.4 ms), so a runtime that sends many small
shards is bound by Ray's task machinery. A replica on the driver's node can instead read its
shards from a Unix socket: ~20,000 small round trips/s on 2 cores, 0.04 ms of CPU a side
(``benchmarks/channel.py``). The frames carry the same bytes a Ray call would.

Frames are a 4-byte little-endian length and a body. A frame from the replica then carries a
4-byte number: the first names the replica (its token follows), each other one is the sequence
number of the frame it answers (a model that merges shards answers out of order), and its body
starts with ``OK`` or ``ERR``. A closed socket fails every call still waiting on it (``ChannelLost``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import queue
import shutil
import socket
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, TypeVarTuple, cast

from .._core.errors import PipelineClosedError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

OK, ERR = b"\x00", b"\x01"
_NAMING = (0xFFFFFFFF).to_bytes(4, "little")  # the number of a replica's first frame: its token

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class ChannelLost(Exception):
    """The socket closed under a call: the replica's process died (or the channel was shut)."""


class RemoteTraceback(Exception):
    """The replica's traceback of an error sent over a channel (chained as its cause)."""


def _header(size: int) -> bytes:
    return size.to_bytes(4, "little")


def _frames(buffer: bytearray, data: bytes, numbered: bool = False) -> Iterator[tuple[int, bytes]]:
    """Append ``data`` to ``buffer``; yield each whole frame's number (``numbered``; else -1) and
    body, removed from it (the body copied once: replies are the driver's hottest path)."""
    buffer += data
    skip = 4 if numbered else 0
    while len(buffer) >= 4 and len(buffer) >= 4 + (size := int.from_bytes(buffer[:4], "little")):
        seq = int.from_bytes(buffer[4 : 4 + skip], "little") if numbered else -1
        body = bytes(buffer[4 + skip : 4 + size])
        del buffer[: 4 + size]
        yield seq, body


def _as_is(seq: int, value: Any) -> Any:
    return value


def _nothing() -> None:
    pass


class _Job(Generic[T]):
    """A submitted call and the future its submitter waits on (failed if the worker stops);
    ``shard``: a step on a shard, which a merging replica runs beside other shards."""

    __slots__ = ("_call", "future", "shard")

    def __init__(self, call: Callable[[], T], shard: bool = False) -> None:
        self._call = call
        self.future: Future[T] = Future()
        self.shard = shard

    def __call__(self) -> None:
        if self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self._call())
            except BaseException as err:  # the submitter raises it
                self.future.set_exception(err)


class _Shard:
    """A channel frame's step and its reply: a job a merging replica runs beside other shards."""

    __slots__ = ("_call",)
    shard = True

    def __init__(self, call: Callable[[], None]) -> None:
        self._call = call

    def __call__(self) -> None:
        self._call()


class ReplicaWorker:
    """The one thread that runs a replica's user code (the worker), fed in order by its
    channel and by the jobs that Ray calls submit (setup, weights, shards that read stored
    objects); and a second thread that reads the channel.

    A replica's own Python between two steps runs on a cold CPU after the step (on a 1.5 ms
    step, 4x its time in a hot loop), while the model waits for it; so the channel's thread
    reads and unpickles the next shard (``prepare``) while the worker runs the one before. The
    worker still pickles each reply before its next step starts, as a Ray call would: a step's
    outputs may be buffers it reuses.

    With ``merge`` > 1 (a model that merges shards, ``Model.merges_shards``) the worker starts
    each shard's step on a thread of its own, up to ``merge`` at once, and every other job
    (setup, weights) waits until no shard runs and runs alone: weights still load between
    shards, never under a step."""

    def __init__(self, merge: int = 1) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._urgent: collections.deque[Callable[[], None]] = collections.deque()  # before any job queued
        self._channel: socket.socket | None = None
        self._dead = False
        self._merge = merge
        self._running = 0  # shards running on threads of their own (merge > 1)
        self._idle = threading.Condition()
        self._sending = threading.Lock()  # replies from several threads, one frame at a time
        self.thread = threading.Thread(target=self._work, name="flowrl-replica", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[*Ts], T], *args: *Ts, first: bool = False, shard: bool = False) -> Future[T]:
        """Run ``fn(*args)`` on the worker after the jobs queued before it, or with ``first``
        right after the job running now (weights load before the shards queued ahead);
        ``shard``: a step on a shard, run beside others where the replica merges them."""
        job = _Job(functools.partial(fn, *args), shard)
        if first:
            self._urgent.append(job)
            self._jobs.put(_nothing)  # wakes an idle worker
        else:
            self._jobs.put(job)
        if self._dead:
            self._fail_jobs()
        return job.future

    def connect(
        self, path: str, token: str, answer: Callable[[int, Any], bytes], prepare: Callable[[int, bytes], Any] = _as_is
    ) -> None:
        """Serve the driver's channel at ``path``: each frame goes ``prepare(seq, body)`` on the
        channel's thread, then ``answer(seq, prepared)`` (the reply's bytes) on the worker;
        neither may raise. Replies go in the order the frames came, unless the replica merges
        shards."""
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(path)
        sock.sendall(_header(4 + len(token)) + _NAMING + token.encode())
        self._channel = sock
        threading.Thread(target=self._read, args=(sock, answer, prepare), name="flowrl-channel", daemon=True).start()

    def close_channel(self) -> None:
        """Stop serving: the driver's waiting calls fail as if this process had died."""
        if self._channel is not None:
            with contextlib.suppress(OSError):
                self._channel.shutdown(socket.SHUT_RDWR)

    def _work(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                while self._urgent:
                    self._alone(self._urgent.popleft())
                if self._merge > 1 and getattr(job, "shard", False):
                    self._beside(job)
                else:
                    self._alone(job)
        finally:
            self._stop()

    def _alone(self, job: Callable[[], None]) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0)
        job()

    def _beside(self, job: Callable[[], None]) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._running < self._merge)
            self._running += 1
        threading.Thread(target=self._shard, args=(job,), name="flowrl-shard", daemon=True).start()

    def _shard(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException:
            self._stop()
            raise
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def _stop(self) -> None:
        """A bug here must not leave anyone waiting: the driver sees the channel close, and Ray
        calls get an error instead of a thread that never runs."""
        self._dead = True
        self.close_channel()
        self._fail_jobs()

    def _fail_jobs(self) -> None:
        while True:
            try:
                job = self._urgent.popleft() if self._urgent else self._jobs.get_nowait()
            except queue.Empty:
                return
            if isinstance(job, _Job) and job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError("the replica's worker thread stopped"))

    def _read(
        self, sock: socket.socket, answer: Callable[[int, Any], bytes], prepare: Callable[[int, bytes], Any]
    ) -> None:
        buffer, seq = bytearray(), 0
        try:
            while chunk := sock.recv(1 << 20):
                for _, body in _frames(buffer, chunk):
                    reply = functools.partial(self._reply, sock, answer, seq, prepare(seq, body))
                    self._jobs.put(_Shard(reply))
                    seq += 1
        except OSError:  # shut down under it (close_channel), or the driver went away
            pass

    def _reply(self, sock: socket.socket, answer: Callable[[int, Any], bytes], seq: int, prepared: Any) -> None:
        data = answer(seq, prepared)
        with self._sending, contextlib.suppress(OSError):  # the driver went away: nobody waits for it
            sock.sendall(_header(4 + len(data)) + seq.to_bytes(4, "little") + data)


class _Writer(Protocol):
    """What the driver's end uses of its transport: asyncio's and uvloop's both have it (uvloop's
    transports do not subclass asyncio's, so an ``isinstance`` check would refuse them)."""

    def writelines(self, data: Any, /) -> None: ...

    def close(self) -> None: ...


class DriverEnd(asyncio.Protocol):
    """The driver's end of one replica's channel, bound to the event loop that accepted it.

    Frames are parsed in the loop's own callback as bytes arrive, and each reply settles its
    call's future there: no reader task to wake per reply. The first frame names the replica.
    """

    def __init__(self, server: ChannelServer) -> None:
        self.loop = asyncio.get_running_loop()
        self._server = server
        self._transport: _Writer | None = None
        self._buffer = bytearray()
        self._named = False
        self._waiting: dict[int, asyncio.Future[bytes]] = {}  # sequence number -> its reply
        self._sent = 0
        self._lost: BaseException | None = None

    def usable(self) -> bool:
        """Open, and called from the loop that owns it."""
        return self._lost is None and asyncio.get_running_loop() is self.loop

    def send(self, body: bytes) -> tuple[int, asyncio.Future[bytes]]:
        """Queue ``body``; returns its sequence number and the future of its reply."""
        assert self._transport is not None
        future = self.loop.create_future()
        seq, self._sent = self._sent, self._sent + 1
        self._waiting[seq] = future
        self._transport.writelines((_header(len(body)), body))  # one system call
        return seq, future

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast("_Writer", transport)  # a Unix stream socket's writes, on any loop

    def data_received(self, data: bytes) -> None:
        for seq, frame in _frames(self._buffer, data, numbered=True):
            if not self._named:
                self._named = True
                self._server.named(self, frame)
            else:
                future = self._waiting.pop(seq, None)
                if future is not None and not future.done():  # else its caller was cancelled
                    future.set_result(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ChannelLost(f"the replica's channel closed{f': {exc}' if exc else ''}"))

    def _fail(self, error: BaseException) -> None:
        self._lost = self._lost or error
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        self._fail(PipelineClosedError("the pipeline closed while this call was in flight"))
        if self._transport is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed already
                self._transport.close()


class ChannelServer:
    """A Unix socket in a private directory; each replica connects and names itself by token."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="flowrl-")  # mode 0700: only this user connects
        self.path = str(Path(self._dir) / "channels.sock")
        self._expected: dict[str, asyncio.Future[DriverEnd]] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: DriverEnd(self), self.path)

    def expect(self, token: str) -> asyncio.Future[DriverEnd]:
        future: asyncio.Future[DriverEnd] = asyncio.get_running_loop().create_future()
        self._expected[token] = future
        return future

    def named(self, end: DriverEnd, token: bytes) -> None:
        """A connection's first frame: the token of the replica it serves."""
        try:
            future = self._expected.pop(token.decode(), None)
        except UnicodeDecodeError:
            future = None
        if future is None or future.done():  # a stranger, or a replica given up on
            end.close()
            return
        future.set_result(end)

    def close(self) -> None:
        for future in self._expected.values():
            future.cancel()
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)
