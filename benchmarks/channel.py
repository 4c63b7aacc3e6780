"""A persistent channel per replica against Ray calls: what one small shard's round trip
costs when it travels over a Unix socket that the replica actor reads in a thread, beside
``ray.util.ActorPool`` pinging the same actors (calls/s, CPU ms per call of the driver and of
the replica processes). The measurement that led to ``PipelineConfig.local_channels``
(``flowrl/_backends/local_channel.py``); this is the bare mechanism, without flowrl around it.

    python benchmarks/channel.py          # Linux (reads /proc)
"""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import struct
import threading
import time
from typing import Any

import call_shape  # beside this file
import ray
from ray.util import ActorPool

CALLS = 4000


def _cpu() -> dict[str, float]:
    return call_shape._cpu(b"ray::Channel")


@ray.remote
class Channel:
    def ping(self) -> bool:
        return True

    def start(self, path: str) -> bool:
        """Serve shard frames (4-byte length, pickled rows) from the driver's socket in a thread."""

        def serve() -> None:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.connect(path)
                reader = sock.makefile("rb")
                while head := reader.read(4):
                    rows = pickle.loads(reader.read(struct.unpack("<I", head)[0]))
                    out = pickle.dumps({"done": [True] * len(rows["k"])})
                    sock.sendall(struct.pack("<I", len(out)) + out)

        threading.Thread(target=serve, daemon=True).start()
        return True


def _line(name: str, seconds: float, before: dict[str, float], after: dict[str, float]) -> str:
    cost = {k: (after[k] - before[k]) / CALLS * 1e3 for k in after}
    return f"| {name} | {CALLS / seconds:.0f} | {cost['driver']:.2f} | {cost['replicas']:.2f} |"


async def main(actors: list[Any], path: str) -> None:
    accepted: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await accepted.put((r, w))

    server = await asyncio.start_unix_server(on_connect, path)
    await asyncio.gather(*(a.start.remote(path) for a in actors))
    conns = [await accepted.get() for _ in actors]
    payload = pickle.dumps({"ids": [1], "k": [0]})
    frame = struct.pack("<I", len(payload)) + payload

    async def slot(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        for _ in range(n):  # one shard in flight per replica, as ActorPool keeps one call
            w.write(frame)
            size = struct.unpack("<I", await r.readexactly(4))[0]
            pickle.loads(await r.readexactly(size))

    print("| calls of | calls/s | driver CPU ms per call | replica CPU ms per call |\n| --- | --- | --- | --- |")
    for _ in range(2):
        before, start = _cpu(), time.perf_counter()
        await asyncio.gather(*(slot(r, w, CALLS // len(conns)) for r, w in conns))
        print(_line("a channel per replica (Unix socket)", time.perf_counter() - start, before, _cpu()))
        before, start = _cpu(), time.perf_counter()
        list(ActorPool(actors).map_unordered(lambda a, _: a.ping.remote(), range(CALLS)))
        print(_line("ActorPool: ping", time.perf_counter() - start, before, _cpu()))
    for _, w in conns:
        w.close()
    server.close()


if __name__ == "__main__":
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    sock_path = f"/tmp/flowrl-channel-{os.getpid()}.sock"
    try:
        replicas = [Channel.options(num_cpus=0.05).remote() for _ in range(8)]
        ray.get([a.ping.remote() for a in replicas])
        asyncio.run(main(replicas, sock_path))
    finally:
        if os.path.exists(sock_path):
            os.unlink(sock_path)
        ray.shutdown()
