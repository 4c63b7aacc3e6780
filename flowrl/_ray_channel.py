"""A channel per replica on the driver's node (layer 4, for the Ray backend; no ray import).

A Ray actor call costs both sides far more CPU than its bytes do (on 2 cores a no-op call
takes ~1.6 ms of CPU, submission alone 0.3-0.4 ms), so a runtime that sends many small
shards is bound by Ray's task machinery. A replica on the driver's node can instead read its
shards from a Unix socket: ~20,000 small round trips/s on 2 cores, 0.04 ms of CPU a side
(``benchmarks/channel.py``). The frames carry the same bytes a Ray call would.

Frames are a 4-byte little-endian length and a body. The replica answers frames in the
order they came, so the driver matches replies to calls by order; a reply body starts with
``OK`` or ``ERR``. A closed socket fails every call still waiting on it (``ChannelLost``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from ._errors import PipelineClosedError

OK, ERR = b"\x00", b"\x01"


class ChannelLost(Exception):
    """The socket closed under a call: the replica's process died (or the channel was shut)."""


class RemoteTraceback(Exception):
    """The replica's traceback of an error sent over a channel (chained as its cause)."""


def _header(size: int) -> bytes:
    return size.to_bytes(4, "little")


class ReplicaEnd:
    """The replica's end: a thread reads frames and hands each to ``worker``, whose one thread
    runs ``answer(seq, body)`` and writes the reply; ``answer`` must not raise."""

    def __init__(self, path: str, token: str, worker: Executor, answer: Callable[[int, bytes], bytes]) -> None:
        self._sock = socket.socket(socket.AF_UNIX)
        self._sock.connect(path)
        self._sock.sendall(_header(len(token)) + token.encode())
        self._worker, self._answer = worker, answer
        threading.Thread(target=self._read, name="flowrl-channel", daemon=True).start()

    def _read(self) -> None:
        reader = self._sock.makefile("rb")
        seq = 0
        with contextlib.suppress(OSError, RuntimeError):  # RuntimeError: the worker shut down
            while len(head := reader.read(4)) == 4:
                body = reader.read(int.from_bytes(head, "little"))
                self._worker.submit(self._reply, seq, body)
                seq += 1

    def close(self) -> None:
        """Stop serving: the driver's waiting calls fail as if this process had died."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _reply(self, seq: int, body: bytes) -> None:
        data = self._answer(seq, body)
        with contextlib.suppress(OSError):  # the driver went away: nobody waits for it
            self._sock.sendall(_header(len(data)) + data)


class DriverEnd:
    """The driver's end of one replica's channel, bound to the event loop that opened it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.loop = asyncio.get_running_loop()
        self._reader, self._writer = reader, writer
        self._waiting: collections.deque[asyncio.Future[bytes]] = collections.deque()
        self._sent = 0
        self._lost: BaseException | None = None
        self._task = self.loop.create_task(self._read())

    def usable(self) -> bool:
        """Open, and called from the loop that owns it (asyncio streams are bound to one)."""
        return self._lost is None and asyncio.get_running_loop() is self.loop

    def send(self, body: bytes) -> tuple[int, asyncio.Future[bytes]]:
        """Queue ``body``; returns its sequence number and the future of its reply."""
        future = self.loop.create_future()
        self._waiting.append(future)
        self._writer.write(_header(len(body)))
        self._writer.write(body)
        self._sent += 1
        return self._sent - 1, future

    async def _read(self) -> None:
        try:
            while True:
                size = int.from_bytes(await self._reader.readexactly(4), "little")
                data = await self._reader.readexactly(size)
                future = self._waiting.popleft()
                if not future.done():  # else its caller was cancelled
                    future.set_result(data)
        except (asyncio.IncompleteReadError, OSError) as err:
            self._fail(ChannelLost(f"the replica's channel closed: {type(err).__name__}: {err}"))

    def _fail(self, error: BaseException) -> None:
        self._lost = self._lost or error
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        self._fail(PipelineClosedError("the pipeline closed while this call was in flight"))
        self._task.cancel()
        with contextlib.suppress(RuntimeError):  # its loop has closed already
            self._writer.close()


class ChannelServer:
    """A Unix socket in a private directory; each replica connects and names itself by token."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="flowrl-")  # mode 0700: only this user connects
        self.path = str(Path(self._dir) / "channels.sock")
        self._expected: dict[str, asyncio.Future[DriverEnd]] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accept, self.path)

    def expect(self, token: str) -> asyncio.Future[DriverEnd]:
        future: asyncio.Future[DriverEnd] = asyncio.get_running_loop().create_future()
        self._expected[token] = future
        return future

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            size = int.from_bytes(await reader.readexactly(4), "little")
            future = self._expected.pop((await reader.readexactly(size)).decode(), None)
        except (asyncio.IncompleteReadError, OSError, UnicodeDecodeError):
            future = None
        if future is None or future.done():  # a stranger, or a replica given up on
            writer.close()
            return
        future.set_result(DriverEnd(reader, writer))

    def close(self) -> None:
        for future in self._expected.values():
            future.cancel()
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self._dir, ignore_errors=True)
