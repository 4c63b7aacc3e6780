"""Load tests (layer 7): synthetic RL-shaped workloads run by flowrl, by a static push
scheduler as ChatLearn does it, and by Ray Data, side by side with the simulator's
zero-overhead makespan and the strict lower bound.

Model time is a sleep (standing in for GPU time, so two CPU cores are not the bottleneck):
a call of n samples sleeps ``call_s + n * per_sample_s + max(tails of its samples)``, the
same per-sample times the simulator uses.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ._batch import Batch
from ._model import Model
from ._pipeline import open_pipeline
from ._simulate import INPUT, SimStage, StageCost, Workload, simulate, tails


def scenarios() -> dict[str, Workload]:
    """The scenarios of the performance issue, deterministic from their seeds."""
    scorer = StageCost(call_s=0.010, per_sample_s=0.002)
    policy = StageCost(call_s=0.020, tail_median_s=0.020, tail_sigma=0.8)

    def rlhf(samples: int, policy_r: int, policy_b: int, down_r: int, down_b: int, seed: int, cost: StageCost = policy) -> Workload:
        wide = dict(replicas=down_r, batch_size=down_b, cost=scorer)
        return Workload(samples=samples, seed=seed, stages=[
            SimStage(name="policy", replicas=policy_r, batch_size=policy_b, cost=cost),
            SimStage(name="reference", inputs=["policy"], **wide),
            SimStage(name="value", inputs=["policy"], **wide),
            SimStage(name="reward", inputs=["policy", "reference", "value"], **wide),
        ])

    heavy = StageCost(call_s=0.020, tail_median_s=0.030, tail_sigma=1.2)
    tiny = StageCost(call_s=0.001, per_sample_s=0.0005)
    return {
        "chatlearn-209": rlhf(16, 2, 4, 8, 2, seed=209),
        "heavy-tail-256": rlhf(256, 4, 16, 8, 8, seed=1, cost=heavy),
        "prime-97": Workload(samples=97, seed=7, stages=[
            SimStage(name="policy", replicas=7, batch_size=5, cost=policy),
            SimStage(name="reward", inputs=["policy"], replicas=3, batch_size=7, cost=scorer),
        ]),
        "tiny-shards": Workload(samples=400, seed=3, stages=[
            SimStage(name="a", replicas=4, batch_size=1, cost=tiny),
            SimStage(name="b", inputs=["a"], replicas=4, batch_size=1, cost=tiny),
        ]),
    }


class Sleeper(Model):
    """A stage of a workload: sleeps its call time; samples are indexed by the input field ``k``."""

    def __init__(self, name: str, config: dict[str, Any], cost: StageCost, tail: np.ndarray) -> None:
        super().__init__(name, config)
        self.cost, self.tail = cost, tail

    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        k = np.asarray(batch["k"], dtype=np.int64)
        time.sleep(self.cost.call_s + len(k) * self.cost.per_sample_s + float(self.tail[k].max()))
        return {f"{self.name}_done": [True] * len(k)}


def workload_flow(w: Workload) -> Any:
    tail = tails(w)
    models = {
        st.name: Sleeper(st.name, {"num_replicas": st.replicas, "batch_size": st.batch_size, "splitter": st.splitter,
                                   "prefetch": st.prefetch, "cpus_per_replica": 0.05}, st.cost, tail[st.name])
        for st in w.stages
    }

    def flow(x: Any) -> Any:
        nodes = {INPUT: x}
        for st in w.stages:
            nodes[st.name] = models[st.name].forward_step(*[nodes[i] for i in st.inputs])
        return tuple(nodes[st.name] for st in w.stages if not any(st.name in o.inputs for o in w.stages))

    return flow


async def run_flowrl(w: Workload) -> dict[str, Any]:
    items = [{"k": i} for i in range(w.samples)]
    async with open_pipeline(workload_flow(w)) as pipe:
        await pipe.run(items[: min(8, len(items))])  # warm-up: imports, first calls
        before = pipe.stats()
        start = time.perf_counter()
        await pipe.run(items, fields=[f"{w.stages[-1].name}_done"])
        makespan = time.perf_counter() - start
        after = pipe.stats()
    used = {s: sum(1 for a, b in zip(after[f"{s}.forward_step"].replicas, before[f"{s}.forward_step"].replicas)
                   if a.samples > b.samples) for s in (st.name for st in w.stages)}
    return {"makespan_s": makespan, "replicas_used": used}


async def run_push(w: Workload) -> dict[str, Any]:
    """ChatLearn's static push: each upstream batch goes whole, round-robin, to a replica."""
    import ray

    tail = tails(w)
    worker = _push_worker()
    actors = {st.name: [worker.options(num_cpus=0.05).remote(st.cost, tail[st.name]) for _ in range(st.replicas)]
              for st in w.stages}
    await asyncio.gather(*(a.ping.remote() for group in actors.values() for a in group))
    counters = {st.name: 0 for st in w.stages}
    used = {st.name: set() for st in w.stages}
    first = w.stages[0]
    batches = [list(range(i, min(i + first.batch_size, w.samples))) for i in range(0, w.samples, first.batch_size)]

    async def call(stage: str, ids: list[int]) -> None:
        r = counters[stage] % len(actors[stage])
        counters[stage] += 1
        used[stage].add(r)
        await actors[stage][r].work.remote(ids)

    async def one(ids: list[int]) -> None:  # a batch keeps its identity through the flow
        done: dict[str, asyncio.Task[None]] = {}
        for st in w.stages:
            deps = [done[i] for i in st.inputs if i != INPUT]
            done[st.name] = asyncio.ensure_future(_after(deps, call(st.name, ids)))
        await asyncio.gather(*done.values())

    start = time.perf_counter()
    await asyncio.gather(*(one(b) for b in batches))
    makespan = time.perf_counter() - start
    for group in actors.values():
        for a in group:
            ray.kill(a)
    return {"makespan_s": makespan, "replicas_used": {k: len(v) for k, v in used.items()}}


async def _after(deps: list[Any], coro: Any) -> None:
    await asyncio.gather(*deps)
    await coro


@functools.cache
def _push_worker() -> Any:
    import ray  # the baselines are Ray programs; only this module and the backend import it

    @ray.remote
    class PushWorker:
        def __init__(self, cost: StageCost, tail: np.ndarray) -> None:
            self.cost, self.tail = cost, tail

        def ping(self) -> bool:
            return True

        def work(self, ids: list[int]) -> int:
            time.sleep(self.cost.call_s + len(ids) * self.cost.per_sample_s + float(self.tail[ids].max()))
            return len(ids)

    return PushWorker


def raw_substrate(actors: int = 8, calls: int = 400) -> dict[str, float]:
    """A no-op actor call's round trip and ``ray.util.ActorPool`` throughput over ``actors``."""
    import ray
    from ray.util import ActorPool

    worker = _push_worker()
    pool = [worker.options(num_cpus=0.05).remote(StageCost(), np.zeros(1)) for _ in range(actors)]
    ray.get([a.ping.remote() for a in pool])
    start = time.perf_counter()
    for _ in range(calls // 4):
        ray.get(pool[0].ping.remote())
    rtt = (time.perf_counter() - start) / (calls // 4)
    start = time.perf_counter()
    list(ActorPool(pool).map_unordered(lambda a, _: a.ping.remote(), range(calls)))
    throughput = calls / (time.perf_counter() - start)
    for a in pool:
        ray.kill(a)
    return {"round_trip_ms": rtt * 1e3, "actor_pool_calls_per_s": throughput}


def run_scenario(name: str, w: Workload) -> dict[str, Any]:
    zero = simulate(w)
    flow = asyncio.run(run_flowrl(w))
    push = asyncio.run(run_push(w))
    return {
        "scenario": name,
        "samples": w.samples,
        "lower_bound_s": zero.lower_bound_s,
        "simulated_s": zero.makespan_s,
        "flowrl": flow,
        "push": push,
        "flowrl_over_sim": flow["makespan_s"] / zero.makespan_s,
        "flowrl_over_bound": flow["makespan_s"] / zero.lower_bound_s,
        "push_over_flowrl": push["makespan_s"] / flow["makespan_s"],
    }


def report_table(rows: list[dict[str, Any]]) -> str:
    head = "| scenario | samples | bound s | sim s | flowrl s | push s | flowrl/sim | flowrl/bound | push/flowrl | replicas used (flowrl / push) |\n"
    head += "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    lines = []
    for r in rows:
        used = ", ".join(f"{k} {r['flowrl']['replicas_used'][k]}/{r['push']['replicas_used'][k]}" for k in r["flowrl"]["replicas_used"])
        lines.append(
            f"| {r['scenario']} | {r['samples']} | {r['lower_bound_s']:.3f} | {r['simulated_s']:.3f} | "
            f"{r['flowrl']['makespan_s']:.3f} | {r['push']['makespan_s']:.3f} | {r['flowrl_over_sim']:.2f} | "
            f"{r['flowrl_over_bound']:.2f} | {r['push_over_flowrl']:.2f} | {used} |"
        )
    return head + "\n".join(lines) + "\n"


def median_row(runs: list[dict]) -> dict:
    """The run whose flowrl makespan is the median; ratios were measured within each run."""
    runs = sorted(runs, key=lambda r: r["flowrl"]["makespan_s"])
    return runs[len(runs) // 2]


def loadtest_main(argv: list[str] | None = None, command: str = "flowrl loadtest") -> int:
    """``flowrl loadtest``: run the scenarios side by side, write a Markdown table and JSON."""
    import ray

    parser = argparse.ArgumentParser(prog="flowrl loadtest", description="run the load-test scenarios side by side")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenario", action="append", help="only these scenarios")
    parser.add_argument("--out", default="benchmarks.md", help="the Markdown report (a .json lands beside it)")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, w in scenarios().items():
            print(f"{name}: {w.samples} samples, stages " + ", ".join(f"{s.name}({s.replicas}x{s.batch_size})" for s in w.stages))
        return 0
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
    shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != args.out and a != "--out"]
    command = " ".join([command, *shown])
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
        + "\nWhat the numbers say, and what is being tried, is in `docs/dev-notes.md` (performance).\n"
    )
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"raw": raw, "rows": rows}, indent=1))
    print(text)
    return 0
