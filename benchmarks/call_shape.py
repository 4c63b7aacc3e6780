"""Where a no-op shard's cost goes: CPU per call of the driver and of the replica processes,
for ``ray.util.ActorPool`` pinging flowrl's replica actors, ActorPool sending them a prebuilt
no-op shard (the call flowrl makes, without flowrl's scheduling), and flowrl itself.

    python benchmarks/call_shape.py          # Linux (reads /proc)
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import ray
import ray.cloudpickle
from ray.util import ActorPool

from flowrl import open_pipeline
from flowrl._backends.ray_wire import frame as _frame
from flowrl._core.batch import Batch
from flowrl._core.config import Piece, ShardCall, encode_message
from flowrl._tools.baselines import Noop

CALLS = 400
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _cpu(replica: bytes = b"ray::ReplicaActor") -> dict[str, float]:
    """CPU seconds so far of this process and of the actor processes whose title starts so."""
    out = {"driver": _cpu_s(os.getpid()), "replicas": 0.0}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cmdline").read_bytes().startswith(replica):
                    out["replicas"] += _cpu_s(int(proc.name))
            except OSError:
                continue
    return out


def _noop_blob() -> bytes:
    call = ShardCall(
        stage="noop.forward_step",
        method="forward_step",
        iteration=0,
        ids=[0],
        pieces=[Piece(producer="input", ref=-1, rows=[0])],
    )
    return _frame(encode_message(call), ray.cloudpickle.dumps([Batch.from_samples([0], [{"k": 0}])]))


async def main() -> None:
    model = Noop("noop", {"num_replicas": 8, "batch_size": 1, "prefetch": 1, "cpus_per_replica": 0.05})
    items = [{"k": i} for i in range(CALLS)]
    async with open_pipeline(lambda x: model.forward_step(x)) as pipe:
        await pipe.run(items[:16])
        actors = [h.ref for h in pipe.replicas_of("noop")]
        blob = _noop_blob()

        async def flowrl() -> None:
            await pipe.run(items, fields=["noop_done"])

        async def pool(call: Any) -> None:
            list(ActorPool(actors).map_unordered(lambda a, _: call(a), range(CALLS)))

        shapes = {
            "ActorPool: ping": lambda: pool(lambda a: a.ping.remote()),
            "ActorPool: a no-op shard": lambda: pool(lambda a: a.run.remote(blob)[0]),
            "flowrl": flowrl,
        }
        print("| calls of | calls/s | driver CPU ms per call | replica CPU ms per call |\n| --- | --- | --- | --- |")
        for _ in range(2):
            for name, run in shapes.items():
                before, start = _cpu(), time.perf_counter()
                await run()
                wall, after = time.perf_counter() - start, _cpu()
                cost = {k: (after[k] - before[k]) / CALLS * 1e3 for k in after}
                print(f"| {name} | {CALLS / wall:.0f} | {cost['driver']:.2f} | {cost['replicas']:.2f} |")


if __name__ == "__main__":
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(main())
    finally:
        ray.shutdown()
