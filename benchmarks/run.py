"""Run the load-test scenarios side by side and write docs/benchmarks.md and a JSON report.

    python benchmarks/run.py                 # every scenario, 3 repeats (medians)
    python benchmarks/run.py --repeats 1 --scenario chatlearn-209
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import ray

from flowrl._loadtest import raw_substrate, report_table, run_scenario, scenarios

ROOT = Path(__file__).resolve().parents[1]


def median_row(runs: list[dict]) -> dict:
    """The run whose flowrl makespan is the median; ratios were measured within each run."""
    runs = sorted(runs, key=lambda r: r["flowrl"]["makespan_s"])
    return runs[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenario", action="append", help="only these scenarios")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = parser.parse_args(argv)
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        raw = raw_substrate()
        rows = []
        for name, w in scenarios().items():
            if args.scenario and name not in args.scenario:
                continue
            rows.append(median_row([run_scenario(name, w) for _ in range(args.repeats)]))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, Ray {ray.__version__}"
    command = "python benchmarks/run.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (
        "# Benchmarks\n\n"
        f"Latest run: `{command.strip()}` on {machine}. Model time is a sleep (see `flowrl/_loadtest.py`);\n"
        "each row is the median of the repeats, and every ratio was measured within one run.\n\n"
        f"Raw substrate: no-op actor round trip {raw['round_trip_ms']:.2f} ms; `ray.util.ActorPool` over 8 actors "
        f"{raw['actor_pool_calls_per_s']:.0f} calls/s.\n\n"
        "- bound: the strict lower bound (busiest stage's least work per replica, slowest sample's path).\n"
        "- sim: the simulator's makespan for the same pull policy with a free runtime.\n"
        "- push: ChatLearn's static push (each upstream batch whole, round-robin).\n\n"
        + report_table(rows)
    )
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"raw": raw, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
