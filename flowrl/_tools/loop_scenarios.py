"""The load test's loops (issue 23): multi-turn and partial rollouts run through the real
pipeline, beside the simulator of ``_sim/turns.py`` and the strict lower bound.

The models sleep what the simulator's cost model says a call costs (less the OS's lateness in
waking a sleeper, as the other scenarios' models): a policy call ``fixed_s + token_s * (the
most tokens any of its samples writes)``, an environment call ``env_fixed_s + the longest
step``. The modes (``_sim.turns.MODES``):

- ``whole``: whole-sample batches; the policy plays every turn of its shard inside one call
  (an agent loop in a rollout worker), its environment steps side by side in calls of
  ``env_batch``;
- ``turn``: per-turn pull, ``flowrl.loop(lambda s: env.step(policy.generate(s)), ...)``;
- ``partial``: the same loop, the policy writing at most ``budget`` tokens of a sample per call;
  an unfinished segment passes through the environment, which skips it. Without an
  environment the loop is the policy alone, which says when a generation is done.

Each run checks that every sample ran each of its turns exactly once: its turns (or segments)
counted by the loop and by the stages' accounting against the workload's.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .._core.flow.loops import loop
from .._core.flow.model import Model, step
from .._pipeline.opening import open_pipeline
from .._sim.turns import MODES, Turn, TurnWorkload, heavy_tailed, lower_bound, simulate_turns
from .baselines import nominal_sleep, sleep_slack

if TYPE_CHECKING:
    from .._core.flow.batch import Batch
    from .._core.flow.node import Node

__all__ = ["LoopScenario", "loop_report", "loop_scenarios", "run_loop_scenario", "run_loops", "run_mode"]

LABELS = {"whole": "whole-sample batches", "turn": "per-turn pull", "partial": "partial"}
_CPU = {"cpus_per_replica": 0.05}


@dataclass(frozen=True)
class LoopScenario:
    """A loop workload and the modes it runs in; ``workload.budget`` is the partial mode's
    segment (tokens of a sample per call). ``env``: an environment stage between policy turns."""

    workload: TurnWorkload
    modes: tuple[str, ...]
    env: bool = True

    def layout(self, mode: str) -> TurnWorkload:
        return self.workload if mode == "partial" else replace(self.workload, budget=0)

    def describe(self, name: str) -> str:
        w = self.workload
        turns = [len(s) for s in w.samples]
        stages = f"policy({w.policy_replicas}x{w.batch})" + (
            f", env({w.env_replicas}x{w.env_batch})" if self.env else ""
        )
        return (
            f"{name}: {len(turns)} samples, {sum(turns)} turns (1 to {max(turns)} a sample), stages {stages}, "
            f"modes {', '.join(self.modes)} (segments of {w.budget} tokens)"
        )


def multiturn_workload(samples: int = 64, *, seed: int = 23, scale: float = 1.0) -> TurnWorkload:
    """Heavy-tailed turn counts (geometric, mean 3, at most 12) and turn lengths (tokens
    log-normal, mean 200, sigma 1.0; environment steps log-normal, mean 40 ms, sigma 1.0);
    ``scale`` multiplies every time."""
    turns = heavy_tailed(
        samples,
        mean_turns=3,
        max_turns=12,
        mean_tokens=200,
        sigma=1.0,
        mean_env_s=0.04 * scale,
        env_sigma=1.0,
        seed=seed,
    )
    return TurnWorkload(turns, 4, 8, 4, 8, fixed_s=0.02 * scale, token_s=0.0004 * scale, env_fixed_s=0.004 * scale)


def partial_workload(samples: int = 256, *, seed: int = 24, scale: float = 1.0) -> TurnWorkload:
    """One long-tailed generation a sample (tokens log-normal, mean 200, sigma 1.2), no
    environment; ``scale`` multiplies every time."""
    drawn = heavy_tailed(
        samples, mean_turns=1, max_turns=1, mean_tokens=200, sigma=1.2, mean_env_s=1.0, env_sigma=0.0, seed=seed
    )
    turns = tuple((Turn(s[0].tokens, 0.0),) for s in drawn)
    return TurnWorkload(turns, 4, 8, 4, 8, fixed_s=0.01 * scale, token_s=0.0004 * scale, env_fixed_s=0.0)


def loop_scenarios() -> dict[str, LoopScenario]:
    """The loop scenarios of issue 23, deterministic from their seeds."""
    return {
        "multiturn": LoopScenario(replace(multiturn_workload(), budget=128), MODES),
        "partial": LoopScenario(replace(partial_workload(), budget=128), ("whole", "partial"), env=False),
    }


def segments(w: TurnWorkload) -> list[int]:
    """Per sample, the policy calls it takes part in: a turn's generation cut into segments of
    ``budget`` tokens (one segment a turn without a budget)."""
    return [sum(-(-t.tokens // w.budget) if w.budget else 1 for t in s) for s in w.samples]


class Policy(Model):
    """Writes the current turn's tokens, at most ``budget`` of each sample a call (0: all);
    ``alone`` (no environment): also says whether the sample's generation is done."""

    def __init__(self, name: str, config: dict[str, Any], w: TurnWorkload, alone: bool = False) -> None:
        super().__init__(name, config)
        self.fixed_s, self.token_s, self.budget, self.alone = w.fixed_s, w.token_s, w.budget, alone

    def setup(self) -> None:
        sleep_slack()

    @step
    def generate(self, batch: Batch, iteration: int) -> dict[str, Any]:
        left = [int(v) for v in batch["left"]]
        write = [min(v, self.budget) if self.budget else v for v in left]
        nominal_sleep(self.fixed_s + self.token_s * max(write))
        rest = [v - k for v, k in zip(left, write, strict=True)]
        return {"left": rest, "done": [v == 0 for v in rest]} if self.alone else {"left": rest}


class Env(Model):
    """Steps the samples whose generation is done (skips the others: a partial segment)."""

    def __init__(self, name: str, config: dict[str, Any], w: TurnWorkload) -> None:
        super().__init__(name, config)
        self.env_fixed_s = w.env_fixed_s
        self.turns = [[(t.tokens, t.env_s) for t in s] for s in w.samples]

    def setup(self) -> None:
        sleep_slack()

    @step
    def step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        turn, left, longest = [], [], 0.0
        for i, t, rest in zip(batch["sample"], batch["turn"], batch["left"], strict=True):
            i, t = int(i), int(t)
            if rest == 0:  # the generation is done: its environment step, then the next turn
                longest = max(longest, self.turns[i][t][1])
                t += 1
                rest = self.turns[i][t][0] if t < len(self.turns[i]) else 0
            turn.append(t)
            left.append(int(rest))
        nominal_sleep(self.env_fixed_s + longest)
        done = [t == len(self.turns[int(i)]) for i, t in zip(batch["sample"], turn, strict=True)]
        return {"turn": turn, "left": left, "done": done}


class Agent(Model):
    """Whole-sample batches: plays every turn of its shard before it returns, and reports the
    generations each sample took part in."""

    def __init__(self, name: str, config: dict[str, Any], w: TurnWorkload, env: bool = True) -> None:
        super().__init__(name, config)
        self.w, self.env = w, env

    def setup(self) -> None:
        sleep_slack()

    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        w, live, turn = self.w, [int(i) for i in batch["sample"]], 0
        played = dict.fromkeys(live, 0)
        while live:
            nominal_sleep(w.policy_s([w.samples[i][turn].tokens for i in live]))
            for i in live:
                played[i] += 1
            if self.env:  # the environment's calls of env_batch run side by side
                chunks = [live[k : k + w.env_batch] for k in range(0, len(live), w.env_batch)]
                nominal_sleep(max(w.env_call_s([w.samples[i][turn].env_s for i in c]) for c in chunks))
            turn += 1
            live = [i for i in live if len(w.samples[i]) > turn]
        return {"played": [played[int(i)] for i in batch["sample"]]}


def _flow(spec: LoopScenario, mode: str) -> tuple[Any, dict[str, str]]:
    """The flow of a mode, and its stages by role (``policy``, ``env``)."""
    w = spec.layout(mode)
    if mode == "whole":  # full batches in arrival order, as the simulator's
        agent = Agent(
            "policy",
            {"num_replicas": w.policy_replicas, "batch_size": w.batch, "splitter": "greedy", **_CPU},
            w,
            spec.env,
        )
        return agent.forward_step, {"policy": "policy.forward_step"}
    policy: Any = Policy(
        "policy", {"num_replicas": w.policy_replicas, "batch_size": w.batch, **_CPU}, w, alone=not spec.env
    )
    env: Any = Env("env", {"num_replicas": w.env_replicas, "batch_size": w.env_batch, **_CPU}, w)

    def body(s: Node) -> Node:
        out: Node = env.step(policy.generate(s)) if spec.env else policy.generate(s)
        return out

    def flow(x: Node) -> Node:
        return loop(body, x, until="done", max_turns=max(segments(w)) + 1)

    return flow, {"policy": "policy.generate", **({"env": "env.step"} if spec.env else {})}


async def run_mode(spec: LoopScenario, mode: str, backend: str = "ray") -> dict[str, Any]:
    """One timed run of a mode (after a warm-up sample), checked: each sample's generations
    (turns, or segments) ran exactly once each. What it measured, counts included."""
    w = spec.layout(mode)
    flow, stages = _flow(spec, mode)
    config = {"backend": backend, "inprocess_threads": True, "progress": "off"}
    items = [{"sample": i, "turn": 0, "left": s[0].tokens} for i, s in enumerate(w.samples)]
    async with open_pipeline(flow, config) as pipe:
        await pipe.run(items[:1])
        before = pipe.stats()
        start = time.perf_counter()
        out = await pipe.run(items)
        took = time.perf_counter() - start
        after = pipe.stats()
    expected = [len(s) for s in w.samples] if mode == "whole" else segments(w)
    ran = [int(s["played"]) for s in out] if mode == "whole" else [int(s["loop_turns"]) for s in out]
    counts = {role: after[st].samples - before[st].samples for role, st in stages.items()}
    each = len(w.samples) if mode == "whole" else sum(expected)  # the samples every stage must have taken
    if ran != expected or any(n != each for n in counts.values()):
        raise RuntimeError(
            f"{mode}: generations ran {ran} (stages {counts}), expected {expected} (sum {sum(expected)})"
        )
    if mode != "whole" and spec.env and [int(s["turn"]) for s in out] != [len(s) for s in w.samples]:
        raise RuntimeError(f"{mode}: turns lost or repeated")
    return {
        "makespan_s": took,
        "policy_calls": after[stages["policy"]].calls - before[stages["policy"]].calls,
        "samples_by_stage": counts,
        "generations": sum(ran),
    }


def run_loop_scenario(name: str, spec: LoopScenario, repeats: int = 3, backend: str = "ray") -> list[dict[str, Any]]:
    """A row per mode: the median of ``repeats`` runs (the modes in turns, which goes first
    alternating), beside the lower bound and the simulator's makespan for that mode."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in spec.modes}
    for r in range(repeats):
        for mode in spec.modes if r % 2 == 0 else tuple(reversed(spec.modes)):
            runs[mode].append(asyncio.run(run_mode(spec, mode, backend)))
    bound = lower_bound(spec.workload)
    rows = []
    for mode in spec.modes:
        sim = simulate_turns(spec.layout(mode), mode)
        median = sorted(runs[mode], key=lambda x: x["makespan_s"])[len(runs[mode]) // 2]
        rows.append(
            {
                "scenario": name,
                "mode": mode,
                "samples": len(spec.workload.samples),
                "turns": sum(len(s) for s in spec.workload.samples),
                "lower_bound_s": bound,
                "simulated_s": sim.makespan_s,
                "sim_policy_calls": sim.policy_calls,
                "sim_generations": sim.segments,
                "flowrl": median,
                "runs_s": [x["makespan_s"] for x in runs[mode]],
                "flowrl_over_bound": median["makespan_s"] / bound,
                "flowrl_over_sim": median["makespan_s"] / sim.makespan_s,
            }
        )
    whole = next((r["flowrl"]["makespan_s"] for r in rows if r["mode"] == "whole"), None)
    for row in rows:
        row["over_whole"] = None if whole is None else row["flowrl"]["makespan_s"] / whole
    return rows


def run_loops(only: list[str] | None, repeats: int, backend: str = "ray") -> list[dict[str, Any]]:
    """The rows of the loop scenarios (those in ``only``, when given), each printed as JSON."""
    rows = []
    for name, spec in loop_scenarios().items():
        if only is None or name in only:
            rows += run_loop_scenario(name, spec, repeats, backend)
            for row in rows[-len(spec.modes) :]:
                print(json.dumps(row), flush=True)
    return rows


def loop_report(rows: list[dict[str, Any]]) -> str:
    """The loops' section of the report ("" without rows)."""
    if not rows:
        return ""
    lines = [
        "| scenario | mode | samples | turns | generations (sim) | bound s | sim s | flowrl s | flowrl/bound "
        "| flowrl/sim | / whole | policy calls (sim) | runs s |",
        "|" + " --- |" * 13,
    ]
    for r in rows:
        f = r["flowrl"]
        lines.append(
            f"| {r['scenario']} | {LABELS[r['mode']]} | {r['samples']} | {r['turns']} | {f['generations']} "
            f"({r['sim_generations']}) | {r['lower_bound_s']:.3f} | {r['simulated_s']:.3f} | {f['makespan_s']:.3f} "
            f"| {r['flowrl_over_bound']:.2f} | {r['flowrl_over_sim']:.2f} | "
            + ("-" if r["over_whole"] is None else f"{r['over_whole']:.2f}")
            + f" | {f['policy_calls']} ({r['sim_policy_calls']}) | {' '.join(f'{s:.2f}' for s in r['runs_s'])} |"
        )
    return (
        "\n## Loop scenarios: multi-turn and partial rollouts (flowrl.loop)\n\n"
        "Modes (flowrl/_tools/loop_scenarios.py): whole-sample batches (every turn of a shard played inside\n"
        "one call), per-turn pull (each turn pulled on its own through `flowrl.loop`) and partial (the same\n"
        "loop, a policy call writing at most a segment of each sample). bound: the strict lower bound;\n"
        "sim: `_sim/turns.py`, a free runtime; / whole: against whole-sample batches' time.\n"
        "generations: the samples of the policy's generation calls, counted by the run (each sample's turns\n"
        "or segments, checked to have run exactly once) and by the simulator. policy calls: the policy\n"
        "stage's calls (whole: its shards; the simulator counts the generation calls inside them).\n\n"
        + "\n".join(lines)
        + "\n"
    )
