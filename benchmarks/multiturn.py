"""Multi-turn rollouts on a real Ray cluster: whole-sample batches, per-turn pull (flowrl.loop)
and partial rollouts, against the strict lower bound and the simulator (flowrl/_core/sim_turns.py).

The models sleep what the simulator's cost model says a call costs: a policy call
``fixed + per-token * (the most tokens any of its samples writes)``, an environment call
``env_fixed + the longest step``. The workload (turn counts geometric, tokens and environment
seconds per turn log-normal) is drawn once; the modes run in turns, ``--repeats`` times.

    python benchmarks/multiturn.py --repeats 3 --out /tmp/multiturn.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import flowrl
from flowrl._core.sim_turns import MODES, TurnWorkload, heavy_tailed, lower_bound, simulate_turns

CPU = {"cpus_per_replica": 0.25}


class Policy(flowrl.Model):
    """Writes the current turn's tokens, at most ``budget`` of each sample a call (0: all)."""

    def __init__(self, name: str, config: dict[str, Any], w: TurnWorkload) -> None:
        super().__init__(name, config)
        self.fixed_s, self.token_s, self.budget = w.fixed_s, w.token_s, w.budget

    @flowrl.step
    def generate(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        left = [int(v) for v in batch["left"]]
        write = [min(v, self.budget) if self.budget else v for v in left]
        time.sleep(self.fixed_s + self.token_s * max(write))
        return {"left": [v - k for v, k in zip(left, write, strict=True)]}


class Env(flowrl.Model):
    """Steps the samples whose generation is done (skips the others: a partial segment)."""

    def __init__(self, name: str, config: dict[str, Any], w: TurnWorkload) -> None:
        super().__init__(name, config)
        self.env_fixed_s = w.env_fixed_s
        self.turns = [[(t.tokens, t.env_s) for t in s] for s in w.samples]

    @flowrl.step
    def step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        turn, left, longest = [], [], 0.0
        for i, t, rest in zip(batch["sample"], batch["turn"], batch["left"], strict=True):
            i, t = int(i), int(t)
            if rest == 0:  # the generation is done: its environment step, then the next turn
                longest = max(longest, self.turns[i][t][1])
                t += 1
                rest = self.turns[i][t][0] if t < len(self.turns[i]) else 0
            turn.append(t)
            left.append(int(rest))
        time.sleep(self.env_fixed_s + longest)
        done = [t == len(self.turns[int(i)]) for i, t in zip(batch["sample"], turn, strict=True)]
        return {"turn": turn, "left": left, "done": done}


class Agent(flowrl.Model):
    """Whole-sample batches: plays every turn of its shard before it returns."""

    def __init__(self, name: str, config: dict[str, Any], w: TurnWorkload) -> None:
        super().__init__(name, config)
        self.w = w

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        w, live, turn = self.w, [int(i) for i in batch["sample"]], 0
        while live:
            time.sleep(w.policy_s([w.samples[i][turn].tokens for i in live]))
            chunks = [live[k : k + w.env_batch] for k in range(0, len(live), w.env_batch)]
            time.sleep(max(w.env_call_s([w.samples[i][turn].env_s for i in c]) for c in chunks))  # side by side
            turn += 1
            live = [i for i in live if len(w.samples[i]) > turn]
        return {"turns": [len(w.samples[int(i)]) for i in batch["sample"]]}


def run_mode(w: TurnWorkload, mode: str, backend: str) -> tuple[float, int]:
    """The run's makespan (seconds) and its policy calls."""
    config = {"backend": backend, "inprocess_threads": True, "progress": "off"}
    items = [{"sample": i, "turn": 0, "left": s[0].tokens} for i, s in enumerate(w.samples)]
    if mode == "whole":
        static = {"num_replicas": w.policy_replicas, "batch_size": w.batch, "splitter": "greedy", **CPU}
        agent = Agent("policy", static, w)  # full batches in arrival order, as the simulator's
        flow: Any = agent.forward_step
        stage = "policy.forward_step"
    else:
        policy = Policy("policy", {"num_replicas": w.policy_replicas, "batch_size": w.batch, **CPU}, w)
        env = Env("env", {"num_replicas": w.env_replicas, "batch_size": w.env_batch, **CPU}, w)
        longest = max(len(s) for s in w.samples) * (max(t.tokens for s in w.samples for t in s) + 1)

        def flow(x: Any) -> Any:
            return flowrl.loop(lambda s: env.step(policy.generate(s)), x, until="done", max_turns=longest)

        stage = "policy.generate"
    with flowrl.Pipeline(flow, config) as pipe:
        pipe.run(items[:1])  # warm: replicas started, first calls made
        before = pipe.stats()[stage].calls
        start = time.perf_counter()
        out = pipe.run(items)
        took = time.perf_counter() - start
        calls = pipe.stats()[stage].calls - before
    if mode != "whole":
        assert [int(s["turn"]) for s in out] == [len(s) for s in w.samples], "turns lost or repeated"
    return took, calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--budget", type=int, default=128, help="partial: tokens per sample per call")
    parser.add_argument("--backend", choices=["ray", "inprocess"], default="ray")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    samples = heavy_tailed(
        args.samples, mean_turns=3, max_turns=12, mean_tokens=200, sigma=1.0, mean_env_s=0.04, env_sigma=1.0, seed=23
    )
    w = TurnWorkload(samples, 4, 8, 4, 8, fixed_s=0.02, token_s=0.0004, env_fixed_s=0.004)
    layouts = {"whole": w, "turn": w, "partial": replace(w, budget=args.budget)}
    bound = lower_bound(w)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    calls: dict[str, int] = {}
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):  # which goes first alternates
            took, calls[mode] = run_mode(layouts[mode], mode, args.backend)
            times[mode].append(took)
            print(f"repeat {r} {mode:8s} {took:6.2f} s", flush=True)
    rows = []
    for mode in MODES:
        sim = simulate_turns(layouts[mode], mode)
        med = statistics.median(times[mode])
        rows.append(
            {
                "mode": mode,
                "seconds": med,
                "runs": times[mode],
                "over_bound": med / bound,
                "sim_s": sim.makespan_s,
                "measured_over_sim": med / sim.makespan_s,
                "policy_calls": calls[mode],
                "sim_policy_calls": sim.policy_calls,
            }
        )
    turns = [len(s) for s in samples]
    print(f"\n{len(samples)} samples, {sum(turns)} turns (1 to {max(turns)} a sample); lower bound {bound:.2f} s")
    print("| mode | seconds (median) | / bound | simulator (s) | measured / simulator | calls (sim: generations) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row['mode']} | {row['seconds']:.2f} | {row['over_bound']:.2f} | {row['sim_s']:.2f} | "
            f"{row['measured_over_sim']:.2f} | {row['policy_calls']} ({row['sim_policy_calls']}) |"
        )
    print("\nThe simulator alone, partial rollouts by token budget (tokens per sample per call):")
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
