"""Load tests: synthetic RL-shaped workloads (``scenarios.py``) run by flowrl, by a static
push scheduler as ChatLearn does it, and by Ray Data, side by side with the simulator's
zero-overhead makespan and the strict lower bound; optionally under a CPU hog.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .._core.scheduling.lengths import LengthMemory
from .._pipeline.opening import open_pipeline
from .._sim.epochs import prompt_keys, simulate_epochs
from .._sim.simulate import Workload, cost_hints, tails
from .baselines import cpu_hog, run_push, run_ray_data, substrate
from .loadtest_report import report
from .loop_scenarios import loop_report, loop_scenarios, run_loops
from .scenarios import EPOCHS, items, scenarios, workload_flow

if TYPE_CHECKING:
    from .._core.observe.pipeline_stats import PipelineStats, StageStats

__all__ = ["loadtest_main", "run_flowrl", "scenarios"]

_turns = itertools.count()


async def run_flowrl(w: Workload, epochs: int = 1, *, remember: bool = True) -> list[dict[str, Any]]:
    """flowrl on the workload (after a warm-up run), with what the harness reports of it, per
    epoch. From the second epoch on, each sample's cost is predicted by a ``LengthMemory`` of
    the lengths its prompt had (the first stage's ``<stage>_length``), as the engine does."""
    hints = cost_hints(w, tails(w))
    config = {} if hints is None else {"cost_field": "cost"}
    first, last = w.stages[0].name, w.stages[-1].name
    prompts = prompt_keys(w)
    memory, out = LengthMemory(), []
    async with open_pipeline(workload_flow(w, epochs), config) as pipe:
        await pipe.run(items(w, 0, hints)[: min(8, w.samples)])  # warm-up: imports, first calls
        for epoch in range(epochs):
            costs = memory.costs(prompts) if remember and len(memory) else None
            before = pipe.stats()
            cpu, start = time.process_time(), time.perf_counter()
            done = await pipe.run(items(w, epoch, hints), fields=[f"{last}_done", f"{first}_length"], costs=costs)
            makespan = time.perf_counter() - start
            cpu = time.process_time() - cpu
            memory.observe(prompts, [s[f"{first}_length"] for s in done])
            out.append(_flowrl_report(w, before, pipe.stats(), makespan, cpu))
    return out


def _flowrl_report(
    w: Workload, before: PipelineStats, after: PipelineStats, makespan: float, cpu: float
) -> dict[str, Any]:
    stages = {
        st.name: _stage_report(after[f"{st.name}.forward_step"], before[f"{st.name}.forward_step"], makespan)
        for st in w.stages
    }
    return {
        "makespan_s": makespan,
        "replicas_used": {name: r["replicas_used"] for name, r in stages.items()},
        "stages": stages,
        "driver_cpu_s": cpu,
        "driver_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _stage_report(after: StageStats, before: StageStats, makespan: float) -> dict[str, Any]:
    """One stage's share of one run: the difference of two stats snapshots."""
    busy = [a.busy_s - b.busy_s for a, b in zip(after.replicas, before.replicas, strict=True)]
    samples = [a.samples - b.samples for a, b in zip(after.replicas, before.replicas, strict=True)]
    sizes = {k: v - before.shard_sizes.get(k, 0) for k, v in after.shard_sizes.items()}
    return {
        "calls": after.calls - before.calls,
        "replicas_used": sum(1 for n in samples if n),
        "busy_fraction": sum(busy) / (len(busy) * makespan),
        "replica_busy_fraction": [round(b / makespan, 3) for b in busy],
        "shard_sizes": {k: v for k, v in sizes.items() if v},
        "out_bytes": after.out_bytes - before.out_bytes,
        "overhead_ms_per_shard": 1e3 * (after.overhead_s - before.overhead_s) / max(1, after.calls - before.calls),
    }


def run_scenario(name: str, w: Workload, raw: dict[str, float], before: str | None = None) -> list[dict[str, Any]]:
    """One scenario run by flowrl and by static push, beside simulations: free, with the
    substrate's serial shard time as every call's overhead, and with the substrate's measured
    capacity too (no-op shards a second: ``dispatch_s``; a lone call still takes the serial time).
    A row per epoch (``scenarios.EPOCHS``; the simulations fed by the same length memory).
    ``before``: also run flowrl as it was before issue 22 (that splitter, no length memory);
    ``SPLITTER/K``: with at most K micro-batches a shard."""
    epochs = EPOCHS.get(name, 1)
    overhead_s, dispatch_s = raw["shard_ms"] / 1e3, 1 / raw["flowrl_shards_per_s"]
    zero = simulate_epochs(w, epochs)
    loaded = simulate_epochs(msgspec.structs.replace(w, overhead_s=overhead_s), epochs)
    capped = simulate_epochs(
        msgspec.structs.replace(w, overhead_s=max(0.0, overhead_s - dispatch_s), dispatch_s=dispatch_s), epochs
    )
    olds: list[dict[str, Any] | None] = [None] * epochs
    was = None
    if before is not None:
        splitter, _, most = before.partition("/")
        kept = {"splitter": splitter} | ({"shard_micro_batches": int(most)} if most else {})
        was = msgspec.structs.replace(w, stages=[msgspec.structs.replace(s, **kept) for s in w.stages])
    # which goes first alternates from repeat to repeat: the second pipeline of a process runs warmer
    now_first = next(_turns) % 2 == 0
    if was is not None and not now_first:
        olds = list(asyncio.run(run_flowrl(was, epochs, remember=False)))
    flows = asyncio.run(run_flowrl(w, epochs))
    if was is not None and now_first:
        olds = list(asyncio.run(run_flowrl(was, epochs, remember=False)))
    rows = []
    for e, flow in enumerate(flows):
        old = olds[e]
        push = asyncio.run(run_push(msgspec.structs.replace(w, epoch=e)))
        stages = flow["stages"].values()
        measured = sum(st["overhead_ms_per_shard"] * st["calls"] for st in stages) / sum(st["calls"] for st in stages)
        fitted = simulate_epochs(msgspec.structs.replace(w, overhead_s=measured / 1e3), e + 1)[e]
        rows.append(
            {
                "scenario": name if epochs == 1 else f"{name} e{e + 1}",
                "samples": w.samples,
                "lower_bound_s": zero[e].lower_bound_s,
                "simulated_s": zero[e].makespan_s,
                "simulated_with_overhead_s": loaded[e].makespan_s,
                "simulated_with_capacity_s": capped[e].makespan_s,
                "run_overhead_ms": measured,
                "simulated_with_run_overhead_s": fitted.makespan_s,
                "flowrl": flow,
                "push": push,
                "ray_data": None,
                "flowrl_over_sim": flow["makespan_s"] / zero[e].makespan_s,
                "flowrl_over_sim_with_overhead": flow["makespan_s"] / loaded[e].makespan_s,
                "flowrl_over_sim_with_capacity": flow["makespan_s"] / capped[e].makespan_s,
                "flowrl_over_sim_with_run_overhead": flow["makespan_s"] / fitted.makespan_s,
                "flowrl_over_bound": flow["makespan_s"] / zero[e].lower_bound_s,
                "push_over_flowrl": push["makespan_s"] / flow["makespan_s"],
                "before": old,
                "before_over_flowrl": None if old is None else old["makespan_s"] / flow["makespan_s"],
                "ray_data_over_flowrl": None,
            }
        )
    return rows


def with_ray_data(row: dict[str, Any], w: Workload) -> dict[str, Any]:
    """``row`` with a Ray Data run of the same workload (once per scenario: on this machine its
    actor pools take about 45 s to start for each execution)."""
    data = run_ray_data(w)
    return {**row, "ray_data": data, "ray_data_over_flowrl": data["makespan_s"] / row["flowrl"]["makespan_s"]}


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose flowrl makespan is the median (ratios were measured within each run),
    with every run's flowrl makespan and its ratio to the simulation and the bound (the spread)."""
    runs = sorted(runs, key=lambda r: r["flowrl"]["makespan_s"])
    keys = ("makespan_s", "over_sim", "over_bound")
    spread = [(r["flowrl"]["makespan_s"], r["flowrl_over_sim"], r["flowrl_over_bound"]) for r in runs]
    return runs[len(runs) // 2] | {"flowrl_repeats": [dict(zip(keys, values, strict=True)) for values in spread]}


def _has_ray_data() -> bool:
    try:
        import pandas  # noqa: F401  (Ray Data needs it; the `bench` extra installs it)
        import ray.data  # noqa: F401
    except ImportError:
        return False
    return True


def loadtest_main(argv: list[str] | None = None, command: str = "flowrl loadtest") -> int:
    """``flowrl loadtest``: run the scenarios side by side, write a Markdown report and JSON."""
    import ray

    parser = argparse.ArgumentParser(prog="flowrl loadtest", description="run the load-test scenarios side by side")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenario", action="append", help="only these scenarios")
    parser.add_argument("--out", default="benchmarks.md", help="the Markdown report (a .json lands beside it)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("--no-ray-data", action="store_true", help="skip the Ray Data baseline")
    parser.add_argument(
        "--before",
        metavar="SPLITTER[/K]",
        help="also run flowrl with this splitter and no length memory (e.g. guided; cost/1: one micro-batch a shard)",
    )
    parser.add_argument(
        "--cpu-hog", type=int, default=0, metavar="N", help="N processes spinning on the CPU during the scenarios"
    )
    args = parser.parse_args(argv)
    if args.list:
        for name, w in scenarios().items():
            print(
                f"{name}: {w.samples} samples, stages "
                + ", ".join(f"{s.name}({s.replicas}x{s.batch_size})" for s in w.stages)
            )
        print("\n".join(spec.describe(name) for name, spec in loop_scenarios().items()))
        return 0
    known = sorted([*scenarios(), *loop_scenarios()])
    if unknown := sorted(set(args.scenario or []) - set(known)):
        parser.error(f"unknown scenario(s) {unknown}; expected some of {known}")
    if args.before and not re.fullmatch(r"[a-z_]+(/[1-9][0-9]*)?", args.before):
        parser.error(f"--before: expected a splitter, optionally /K micro-batches a shard (cost/1): {args.before!r}")
    ray_data = not args.no_ray_data and _has_ray_data()
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    hog = cpu_hog(0)
    try:
        raw = asyncio.run(substrate())
        print(json.dumps(raw), flush=True)
        rows = []
        hog = cpu_hog(args.cpu_hog)
        for name, w in scenarios().items():
            if args.scenario and name not in args.scenario:
                continue
            runs = [run_scenario(name, w, raw, args.before) for _ in range(args.repeats)]
            for e, epoch_rows in enumerate(zip(*runs, strict=True)):
                row = median_row(list(epoch_rows))
                rows.append(with_ray_data(row, w) if ray_data and e == 0 else row)
                print(json.dumps(rows[-1]), flush=True)
        loops = run_loops(args.scenario, args.repeats)
        hog.close()
    finally:
        hog.close()
        ray.shutdown()
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != args.out and a != "--out"]
    text = report(" ".join([command, *shown]).strip(), raw, rows, ray_data) + loop_report(loops)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"raw": raw, "rows": rows, "loops": loops}, indent=1))
    print(text)
    return 0
