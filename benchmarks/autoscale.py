"""The autoscaler against every fixed allocation, on a run whose bottleneck moves.

A two-stage flow (``gen`` then ``score``) runs N samples with a fixed total of replicas: the
Ray cluster has exactly one logical CPU per replica, so a pool grows only where another has
shrunk. In the first half every sample costs ``gen`` 10x what it costs ``score``; in the second
half the reverse. Model time is a sleep per sample (standing in for GPU time). Each fixed split
(gen, score) = (1, T-1) .. (T-1, 1) runs once per repeat, unless its lower bound (each half's
busiest pool's work over its replicas, no overhead) is already above the best split measured;
then the autoscaled run, starting from the even split. The table gives medians and the ratio
best fixed / autoscaled, all measured in one process, interleaved.

    python benchmarks/autoscale.py --repeats 3 [--out docs/autoscale.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import anyio
import numpy as np
import ray

import flowrl

HEAVY, LIGHT = 0.03, 0.003  # seconds per sample


class Stage(flowrl.Model):
    """Sleeps the sum of its samples' costs (field ``cost_<name>``) and passes ``x`` on."""

    def __init__(self, name: str, config: dict[str, Any], src: str) -> None:
        super().__init__(name, config)
        self.src = src

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(float(np.sum(batch[f"cost_{self.name}"])))
        return {f"{self.name}_out": np.asarray(batch[self.src])}


def bound(gen_n: int, score_n: int, n: int) -> float:
    """A fixed split's least time: in each half, its busiest pool's work over its replicas."""
    half = n / 2
    return max(half * HEAVY / gen_n, half * LIGHT / score_n) + max(half * LIGHT / gen_n, half * HEAVY / score_n)


def items(n: int) -> list[dict[str, Any]]:
    half = n // 2
    return [
        {"x": np.zeros(1), "cost_gen": HEAVY if i < half else LIGHT, "cost_score": LIGHT if i < half else HEAVY}
        for i in range(n)
    ]


async def one_run(gen_n: int, score_n: int, total: int, n: int, autoscale: bool) -> tuple[float, list[Any]]:
    def cfg(r: int) -> dict[str, Any]:
        scale = {"autoscale": {"min_replicas": 1, "max_replicas": total - 1, "every_s": 0.2, "patience": 2}}
        return {"num_replicas": r, "batch_size": 4, "cpus_per_replica": 1, **(scale if autoscale else {})}

    gen, score = Stage("gen", cfg(gen_n), "x"), Stage("score", cfg(score_n), "gen_out")
    async with flowrl.open_pipeline(
        lambda x: score.forward_step(gen.forward_step(x)), {"progress": "off", "max_inflight": 64}
    ) as pipe:
        start = time.perf_counter()
        out = await pipe.run(items(n), fields=["score_out"])
        took = time.perf_counter() - start
        assert len(out) == n
        return took, list(pipe.scale_events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--replicas", type=int, default=6, help="total replicas of the two pools")
    parser.add_argument("--out", help="write the raw figures here (JSON)")
    args = parser.parse_args()
    total, n = args.replicas, args.samples
    ray.init(num_cpus=total, include_dashboard=False, log_to_driver=False)
    splits = sorted(((g, total - g) for g in range(1, total)), key=lambda x: bound(*x, n))
    times: dict[str, list[float]] = {f"fixed {g}+{s}": [] for g, s in splits} | {"autoscaled": []}
    events: list[str] = []
    try:
        for _ in range(args.repeats):
            best_yet = float("inf")
            for g, s in splits:  # most promising first
                if bound(g, s, n) >= best_yet:
                    continue
                took = anyio.run(one_run, g, s, total, n, False)[0]
                times[f"fixed {g}+{s}"].append(took)
                best_yet = min(best_yet, took)
            took, scaled = anyio.run(one_run, total // 2, total - total // 2, total, n, True)
            times["autoscaled"].append(took)
            events = [f"{e.action} {e.model} {e.before}->{e.after}" for e in scaled]
    finally:
        ray.shutdown()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    skipped = [k for k, v in times.items() if not v]
    best = min((k for k in med if k.startswith("fixed")), key=med.get)  # type: ignore[arg-type]
    print(
        f"{n} samples, {total} replicas in all, gen:score cost {HEAVY / LIGHT:g}:1 then 1:{HEAVY / LIGHT:g}; "
        f"medians of {args.repeats}"
    )
    print("| allocation | s | vs autoscaled |\n| --- | --- | --- |")
    for k, v in med.items():
        print(f"| {k}{' (best fixed)' if k == best else ''} | {v:.2f} | {v / med['autoscaled']:.2f}x |")
    if skipped:
        print(f"\nnot run (their lower bound is above the best split's time): {', '.join(skipped)}")
    print(
        f"\nbest fixed / autoscaled = {med[best] / med['autoscaled']:.2f}x; the last autoscaled run's decisions: "
        + ", ".join(events)
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"times": times, "events": events, "samples": n, "replicas": total}, f, indent=1)


if __name__ == "__main__":
    main()
