"""The simulator at scale: makespan over the strict lower bound, and the scheduler's cost per
shard, from 8 to 1,024 replicas per stage with the same work per replica.

    python benchmarks/sim_scaling.py
"""

from __future__ import annotations

import time

from flowrl import simulate
from flowrl._sim.simulate import SimStage, StageCost, Workload

PER_REPLICA = 96  # samples per policy replica


def workload(replicas: int, seed: int = 0, tail: bool = True) -> Workload:
    policy = (
        StageCost(call_s=0.020, tail_median_s=0.030, tail_sigma=1.0)
        if tail
        else StageCost(call_s=0.020, per_sample_s=0.030)
    )
    scorer = StageCost(call_s=0.010, per_sample_s=0.002)
    return Workload(
        samples=PER_REPLICA * replicas,
        seed=seed,
        stages=[
            SimStage(name="policy", replicas=replicas, batch_size=16, cost=policy),
            SimStage(name="reference", inputs=["policy"], replicas=replicas, batch_size=8, cost=scorer),
            SimStage(name="reward", inputs=["policy", "reference"], replicas=replicas, batch_size=8, cost=scorer),
        ],
    )


def rows(sizes: tuple[int, ...] = (8, 32, 128, 512, 1024)) -> list[dict[str, float]]:
    out = []
    for replicas in sizes:
        w = workload(replicas)
        start = time.perf_counter()
        result = simulate(w)
        wall = time.perf_counter() - start
        calls = sum(result.calls.values())
        flat = simulate(workload(replicas, tail=False))
        out.append(
            {
                "replicas": replicas,
                "samples": w.samples,
                "ratio": result.ratio,
                "bound_s": result.lower_bound_s,
                "flat_ratio": flat.ratio,
                "calls": calls,
                "wall_s": wall,
                "us_per_shard": wall / calls * 1e6,
            }
        )
    return out


def section() -> str:
    lines = [
        "## The simulator at scale",
        "",
        "`python benchmarks/sim_scaling.py`: policy (long tail) -> reference -> reward, the same replicas in",
        f"every stage and {PER_REPLICA} samples per replica, so the work per replica stays the same. With a",
        "log-normal policy tail the slowest sample grows with the sample count and sets the bound (bound s);",
        "without a tail (30 ms per sample) the bound is the work per replica.",
        "",
        "| replicas per stage | samples | makespan / bound (tail) | bound s (tail) | makespan / bound (no tail) "
        "| shards | simulate s | scheduler us per shard |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines.extend(
        f"| {r['replicas']} | {r['samples']} | {r['ratio']:.3f} | {r['bound_s']:.2f} | {r['flat_ratio']:.3f} | "
        f"{r['calls']} | {r['wall_s']:.2f} | {r['us_per_shard']:.1f} |"
        for r in rows()
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(section())
