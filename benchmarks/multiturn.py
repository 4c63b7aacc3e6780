"""Multi-turn rollouts on a real Ray cluster: whole-sample batches, per-turn pull (flowrl.loop)
and partial rollouts, against the strict lower bound and the simulator (flowrl/_sim/turns.py).

The scenario, its models and the checked runs are the load test's (flowrl/_tools/loop_scenarios.py;
``flowrl loadtest --scenario multiturn`` runs the same); this script adds other sizes, the
in-process backend and the simulator's table of segment sizes.

    python benchmarks/multiturn.py --repeats 3 --out /tmp/multiturn.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from flowrl._sim.turns import MODES, lower_bound, simulate_turns
from flowrl._tools.loop_scenarios import LoopScenario, loop_report, multiturn_workload, run_loop_scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--budget", type=int, default=128, help="partial: tokens per sample per call")
    parser.add_argument("--backend", choices=["ray", "inprocess"], default="ray")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    w = replace(multiturn_workload(args.samples), budget=args.budget)
    rows = run_loop_scenario("multiturn", LoopScenario(w, MODES), args.repeats, args.backend)
    bound = lower_bound(w)
    turns = [len(s) for s in w.samples]
    print(f"\n{len(turns)} samples, {sum(turns)} turns (1 to {max(turns)} a sample); lower bound {bound:.2f} s")
    print(loop_report(rows))
    print("The simulator alone, partial rollouts by token budget (tokens per sample per call):")
    for budget in (32, 64, 128, 256, 512):
        sim = simulate_turns(replace(w, budget=budget), "partial")
        print(
            f"  budget {budget:4d}: {sim.makespan_s:.2f} s, {sim.makespan_s / bound:.2f}x the bound, "
            f"{sim.policy_calls} calls"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bound_s": bound, "rows": rows, "argv": sys.argv[1:]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
