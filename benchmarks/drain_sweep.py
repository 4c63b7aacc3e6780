"""The cost splitter's drain rule (``call_cost.drain_share``) against the same splitter without
it, in the simulator, over many layouts (issue 22).

Each layout is an RLHF-shaped flow (a generating stage feeding scorers, the last reading the
others) or a two-stage chain, drawn from the load test's costs, with per-call overheads of a
quiet 16-core and a loaded 2-core machine. Prints the distribution of makespan ratios
(with / without) and the worst layouts; the load test's scenarios are listed first.

    python benchmarks/drain_sweep.py            # ~1 minute
"""

from __future__ import annotations

import itertools
import random
import statistics
from unittest import mock

import msgspec

from flowrl._core.scheduler import PoolScheduler
from flowrl._sim.simulate import SimStage, StageCost, Workload, simulate
from flowrl._tools.scenarios import scenarios

COSTS = {
    "scorer": StageCost(call_s=0.010, per_sample_s=0.002),
    "launch": StageCost(call_s=0.015, per_sample_s=0.0005),
    "tiny": StageCost(call_s=0.001, per_sample_s=0.0005),
    "policy": StageCost(call_s=0.020, tail_median_s=0.020, tail_sigma=0.8),
    "heavy": StageCost(call_s=0.020, tail_median_s=0.030, tail_sigma=1.2),
    "generate": StageCost(call_s=0.030, per_sample_s=0.001, tail_median_s=0.010, tail_sigma=0.6),
}


def layouts(n: int, seed: int = 0) -> list[tuple[str, Workload]]:
    rng = random.Random(seed)
    out = []
    for k in range(n):
        up = SimStage(
            name="policy",
            replicas=rng.choice([2, 4, 7, 16, 64]),
            batch_size=rng.choice([4, 8, 16, 32]),
            cost=COSTS[rng.choice(["policy", "heavy", "generate", "launch"])],
        )
        r, b, c = rng.choice([2, 4, 8, 16, 32]), rng.choice([2, 4, 8, 16]), rng.choice(["scorer", "launch", "tiny"])
        down = [
            SimStage(name="reference", inputs=["policy"], replicas=r, batch_size=b, cost=COSTS[c]),
            SimStage(name="reward", inputs=["policy", "reference"], replicas=r, batch_size=b, cost=COSTS[c]),
        ]
        w = Workload(
            stages=[up, *down[: rng.choice([1, 2])]],
            samples=rng.choice([16, 97, 256, 1024]),
            seed=k,
            overhead_s=rng.choice([0.0, 0.0008, 0.004]),
            dispatch_s=rng.choice([0.0, 0.0004]),
            cost_hint_sigma=rng.choice([None, 0.5]),
        )
        name = f"{up.replicas}x{up.batch_size} {up.cost.tail_sigma or 'flat'} -> {r}x{b} {c}, n={w.samples}"
        out.append((name, w))
    return out


def both(w: Workload) -> tuple[float, float]:
    on = simulate(w).makespan_s
    with mock.patch.object(PoolScheduler, "_drain", lambda *_: None):
        off = simulate(w).makespan_s
    return on, off


def main() -> None:
    named = [(name, msgspec.structs.replace(w, overhead_s=o)) for name, w in scenarios().items() for o in (0.0, 0.002)]
    print("| scenario | overhead ms | with s | without s | with / without |")
    print("| --- | --- | --- | --- | --- |")
    for (name, w), o in zip(named, itertools.cycle([0, 2])):
        on, off = both(w)
        print(f"| {name} | {o} | {on:.3f} | {off:.3f} | {on / off:.3f} |")
    rows = []
    for name, w in layouts(300):
        on, off = both(w)
        rows.append((on / off, name, w.overhead_s))
    ratios = sorted(r for r, _, _ in rows)
    q = statistics.quantiles(ratios, n=20)
    print(
        f"\n{len(rows)} layouts, with / without: min {ratios[0]:.3f}, p5 {q[0]:.3f}, median {q[9]:.3f}, "
        f"p95 {q[-1]:.3f}, max {ratios[-1]:.3f}; faster in {sum(r < 0.995 for r in ratios)}, "
        f"slower in {sum(r > 1.005 for r in ratios)}"
    )
    for r, name, o in sorted(rows)[-5:]:
        print(f"  slowest: {r:.3f} {name}, overhead {o * 1e3:.1f} ms")
    for r, name, o in sorted(rows)[:5]:
        print(f"  fastest: {r:.3f} {name}, overhead {o * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
