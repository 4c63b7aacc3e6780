"""Where a load-test scenario's time goes between a replica's steps: every call is stamped
(``forward_step``'s start and end inside the replica; the send and the reply in the driver),
and per stage it reports the step time, the gap between one step's end and the next step's
start on the same replica, and how often the next shard had been sent before the running
one ended (queued ahead) or only after it (a gap the driver caused).

    python benchmarks/call_gaps.py tiny-shards       # any name of `flowrl loadtest --list`
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from typing import Any

import numpy as np
import ray

import flowrl._tools.scenarios as scen
from flowrl import Batch, open_pipeline
from flowrl._backends.ray_backend import RayBackend


class Stamped(scen.Sleeper):
    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        start = time.time()
        out = super().forward_step(batch, iteration)
        return {**out, f"{self.name}_stamp": [(start, time.time())] * len(batch)}


def _report(name: str, span: tuple[float, float], rows: list[tuple[str, int, float, float, float, float]]) -> None:
    start, end = span
    for stage in sorted({r[0] for r in rows}):
        gaps, queued, late, first, last = [], 0, 0, [], []
        for replica in sorted({r[1] for r in rows if r[0] == stage}):
            calls = sorted((r for r in rows if r[0] == stage and r[1] == replica), key=lambda r: r[4])
            first.append(calls[0][4] - start)
            last.append(end - calls[-1][5])
            for prev, nxt in itertools.pairwise(calls):
                gaps.append(nxt[4] - prev[5])
                queued += nxt[2] < prev[5]
                late += nxt[2] >= prev[5]
        ms = np.array(gaps) * 1e3
        step = np.mean([r[5] - r[4] for r in rows if r[0] == stage]) * 1e3
        idle = ms.sum() / len(first)
        sent = (min(r[2] for r in rows if r[0] == stage) - start) * 1e3
        print(
            f"{name} {stage}: makespan {end - start:.3f} s, step {step:.3f} ms, gap between steps median "
            f"{np.median(ms):.3f} ms (p90 {np.percentile(ms, 90):.3f}), next shard sent before the running "
            f"one ended {queued}/{queued + late}; first shard sent after "
            f"{sent:.2f} ms; a replica's idle ms: before its first step "
            f"{np.mean(first) * 1e3:.2f}, between steps {idle:.2f}, after its last {np.mean(last) * 1e3:.2f}"
        )


async def main(name: str) -> None:
    log: list[tuple[str, int, float, float, Any]] = []
    backend: list[RayBackend] = []
    real = RayBackend.call

    async def stamped_call(self: RayBackend, replica: Any, call: Any) -> Any:
        sent = time.time()
        meta, ref = await real(self, replica, call)
        log.append((call.stage, replica.replica_id, sent, time.time(), ref))
        backend[:] = [self]
        return meta, ref

    RayBackend.call = stamped_call  # type: ignore[method-assign]
    scen.Sleeper = Stamped  # type: ignore[misc]
    w = scen.scenarios()[name]
    items = scen.items(w)
    async with open_pipeline(scen.workload_flow(w)) as pipe:
        await pipe.run(items[:8])  # warm-up
        for _ in range(2):
            log.clear()
            start = time.time()  # the replicas stamp their steps by the same clock
            await pipe.run(items, fields=[f"{w.stages[-1].name}_done"])
            span = (start, time.time())
            outputs = await backend[0].fetch([r for *_, r in log])
            rows = [
                (stage, rid, sent, got, *out[f"{stage.split('.')[0]}_stamp"][0])
                for (stage, rid, sent, got, _), out in zip(log, outputs, strict=True)
            ]
            _report(name, span, rows)


if __name__ == "__main__":
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "tiny-shards"))
    finally:
        ray.shutdown()
