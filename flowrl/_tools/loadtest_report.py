"""The load test's Markdown report: the substrate's figures, the scenarios' tables (flowrl
beside static push, the simulator, the bound and Ray Data) and what the columns mean."""

from __future__ import annotations

import os
import platform
from typing import Any


def markdown_table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def report_tables(rows: list[dict[str, Any]]) -> str:
    main = markdown_table(
        [
            "scenario",
            "samples",
            "bound s",
            "sim s",
            "sim+ovh s",
            "flowrl s",
            "push s",
            "Ray Data s",
            "flowrl/sim",
            "flowrl/sim+ovh",
            "flowrl/bound",
            "push/flowrl",
            "Ray Data/flowrl",
            "before/flowrl",
        ],
        [
            [
                r["scenario"],
                r["samples"],
                _f(r["lower_bound_s"], 3),
                _f(r["simulated_s"], 3),
                _f(r["simulated_with_overhead_s"], 3),
                _f(r["flowrl"]["makespan_s"], 3),
                _f(r["push"]["makespan_s"], 3),
                _f((r["ray_data"] or {}).get("makespan_s"), 3),
                _f(r["flowrl_over_sim"]),
                _f(r["flowrl_over_sim_with_overhead"]),
                _f(r["flowrl_over_bound"]),
                _f(r["push_over_flowrl"]),
                _f(r["ray_data_over_flowrl"]),
                _f(r.get("before_over_flowrl")),
            ]
            for r in rows
        ],
    )
    stages = []
    for r in rows:
        for stage, st in r["flowrl"]["stages"].items():
            used = [str(st["replicas_used"]), str(r["push"]["replicas_used"][stage])]
            used.append(str(r["ray_data"]["replicas_used"][stage]) if r["ray_data"] else "-")
            sizes = " ".join(f"{k}:{v}" for k, v in sorted(st["shard_sizes"].items()))
            stages.append(
                [
                    r["scenario"],
                    stage,
                    " / ".join(used),
                    f"{100 * st['busy_fraction']:.0f}",
                    f"{100 * (1 - st['busy_fraction']):.0f}",
                    st["calls"],
                    sizes,
                    f"{st['out_bytes'] / 1024:.1f}",
                    _f(st["overhead_ms_per_shard"], 1),
                ]
            )
    predicted = markdown_table(
        [
            "scenario",
            "flowrl s",
            "sim+ovh s",
            "flowrl/sim+ovh",
            "sim+cap s",
            "flowrl/sim+cap",
            "call overhead in the run ms",
            "sim with it s",
            "flowrl/sim with it",
        ],
        [
            [
                r["scenario"],
                _f(r["flowrl"]["makespan_s"], 3),
                _f(r["simulated_with_overhead_s"], 3),
                _f(r["flowrl_over_sim_with_overhead"]),
                _f(r["simulated_with_capacity_s"], 3),
                _f(r["flowrl_over_sim_with_capacity"]),
                _f(r["run_overhead_ms"]),
                _f(r["simulated_with_run_overhead_s"], 3),
                _f(r["flowrl_over_sim_with_run_overhead"]),
            ]
            for r in rows
        ],
    )
    detail = markdown_table(
        [
            "scenario",
            "stage",
            "replicas used (flowrl / push / Ray Data)",
            "busy %",
            "starved %",
            "calls",
            "shard sizes (size:calls)",
            "output KiB",
            "call overhead ms per shard",
        ],
        stages,
    )
    driver = markdown_table(
        ["scenario", "driver CPU s", "driver peak RSS MiB", "Ray Data wall s (incl. actor start)"],
        [
            [
                r["scenario"],
                _f(r["flowrl"]["driver_cpu_s"]),
                f"{r['flowrl']['driver_peak_rss_mib']:.0f}",
                _f((r["ray_data"] or {}).get("wall_s"), 1),
            ]
            for r in rows
        ],
    )
    return main + "\n" + predicted + "\n" + detail + "\n" + driver


def report(command: str, raw: dict[str, float], rows: list[dict[str, Any]], ray_data: bool) -> str:
    import ray

    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, Ray {ray.__version__}"
    return (
        "# Benchmarks\n\n"
        f"Latest run: `{command}` on {machine}. Model time is a sleep (see `flowrl/_tools/loadtest.py`);\n"
        "each row is the median of the repeats, and every ratio was measured within one run.\n\n"
        "## The substrate: flowrl against raw Ray calls to the same replica actors\n\n"
        f"- no-op round trip {raw['round_trip_ms']:.2f} ms; flowrl one-sample shard back to back "
        f"{raw['shard_ms']:.2f} ms: flowrl's overhead {raw['overhead_ms']:.2f} ms per shard = "
        f"{raw['overhead_over_round_trip']:.2f}x the round trip (target <= 1.5x)\n"
        f"- `ray.util.ActorPool` over 8 replica actors {raw['actor_pool_calls_per_s']:.0f} calls/s; flowrl no-op "
        f"shards over the same actors {raw['flowrl_shards_per_s']:.0f}/s = {raw['throughput_ratio']:.2f}x "
        "(target >= 0.67x)\n\n"
        "## Scenarios\n\n"
        "- bound: the strict lower bound (busiest stage's least work per replica, slowest sample's path).\n"
        "- sim: the simulator's makespan for the same pull policy with a free runtime; sim+ovh: the same\n"
        "  with the measured cost of a shard above (`Workload.overhead_s`) added to every call; sim+cap:\n"
        "  also with the no-op shard rate above as the runtime's capacity (`Workload.dispatch_s`).\n"
        "- push: ChatLearn's static push (each upstream batch whole, round-robin).\n"
        "- before: flowrl as before the cost-aware splitter and the length memory (`--before guided`: the\n"
        "  guided splitter, no memory; `--before cost/1`: one micro-batch a shard), in the same run; `eN`\n"
        "  rows are the epochs of one scenario.\n"
        + (
            "- Ray Data: `map_batches` with an actor pool per stage (`concurrency=replicas`), stages chained in\n"
            "  flow order; timed from its first model call to its last, because its actor pools start with\n"
            "  each execution (the wall time with actor start is in the last table); run once per scenario.\n"
            if ray_data
            else "- Ray Data: not run (`pip install -e .[bench]` installs what it needs).\n"
        )
        + "\n"
        + report_tables(rows)
        + "\nbusy % / starved %: the stage's replicas' time inside calls / outside them, over the makespan\n"
        "(flowrl replicas never block on a full downstream queue: outputs go to the object store and\n"
        "admission is bounded at the source, so there is no blocked time to report). Call overhead: a\n"
        "call's time seen from the driver beyond its time inside the replica's step (Ray's round trip,\n"
        "gathering the shard, flowrl's dispatch, waiting for a CPU); \"sim with it\" feeds the run's own\n"
        "mean call overhead to the simulator.\n\n"
        "What the numbers say, and what was tried, is in docs/benchmarks.md.\n"
    )
