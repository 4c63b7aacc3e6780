"""Is a load-test scenario bound by the machine's CPUs? Runs it with flowrl (after a warm-up)
and reads the whole machine's CPU time from /proc/stat around each run: if the CPU work a run
needs, spread over every core, is close to its makespan, no runtime of the same CPU cost per
call can be faster there.

    python benchmarks/cpu_bound.py tiny-shards          # any name of `flowrl loadtest --list`
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import ray

import flowrl._tools.scenarios as scen
from flowrl import open_pipeline


def busy_seconds() -> float:
    """CPU seconds all cores of the machine spent outside idle and iowait so far."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


async def measure(name: str, repeats: int = 5) -> None:
    w = scen.scenarios()[name]
    items = scen.items(w)
    calls = sum(-(-w.samples // st.batch_size) for st in w.stages)  # at least this many calls
    cores = os.cpu_count() or 1
    async with open_pipeline(scen.workload_flow(w)) as pipe:
        await pipe.run(items[: min(8, len(items))])
        for _ in range(repeats):
            busy, start = busy_seconds(), time.perf_counter()
            await pipe.run(items, fields=[f"{w.stages[-1].name}_done"])
            makespan, busy = time.perf_counter() - start, busy_seconds() - busy
            print(
                f"{name}: makespan {makespan:.3f} s; the machine's CPU work {busy:.3f} s over {cores} cores "
                f"= {busy / cores:.3f} s ({busy / cores / makespan:.0%} of the makespan); "
                f"{busy / calls * 1e6:.0f} us of CPU per call (>= {calls} calls)",
                flush=True,
            )


if __name__ == "__main__":
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        for scenario in sys.argv[1:] or ["tiny-shards"]:
            asyncio.run(measure(scenario))
    finally:
        ray.shutdown()
