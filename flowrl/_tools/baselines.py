"""What a user would otherwise run, on the load test's workloads: ChatLearn's static
push, Ray Data's streaming executor with actor pools, and the raw Ray substrate measured over
flowrl's own replica actors. Like the backend, these are Ray programs.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core.flow.model import Model
from .._pipeline.opening import open_pipeline
from .._sim.push import push_batches, push_replica
from .._sim.simulate import INPUT, StageCost, Workload, tails

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from .._core.flow.batch import Batch


def model_sleep(cost: StageCost, tail: np.ndarray, ids: list[int] | np.ndarray) -> None:
    """The model time of a call of samples ``ids``: its nominal time, slept (see sleep_slack)."""
    nominal_sleep(cost.call_s + len(ids) * cost.per_sample_s + float(tail[ids].max()))


def nominal_sleep(seconds: float) -> None:
    """Sleep ``seconds`` of model time, less the OS's lateness in waking a sleeper (sleep_slack)."""
    if seconds <= 0:
        return
    slack, rate = sleep_slack()
    time.sleep(max(0.0, seconds - slack - rate * seconds))


@functools.cache
def sleep_slack() -> tuple[float, float]:
    """How much longer than asked ``time.sleep`` lasts in this process, as ``a + b * seconds``,
    measured once on the quiet process (a runner calls it before its timed calls).

    The OS wakes a sleeper late (timer slack, a virtual machine's timers): ~0.1 ms on a 1.5 ms
    sleep here, 7% of a tiny shard's model time, and the simulator knows nothing of it. Model
    time stands in for GPU time, which does not overshoot, so each runner sleeps that much less;
    lateness from a loaded machine (waiting for a CPU to wake on) still counts against it."""

    def late(seconds: float) -> float:
        times = []
        for _ in range(15):
            start = time.perf_counter()
            time.sleep(seconds)
            times.append(time.perf_counter() - start - seconds)
        return float(np.median(times))

    short, long = late(0.001), late(0.005)
    rate = max(0.0, (long - short) / 0.004)
    return max(0.0, short - rate * 0.001), min(rate, 0.1)


async def run_push(w: Workload) -> dict[str, Any]:
    """ChatLearn's static push: each upstream batch goes whole, round-robin, to a replica,
    which runs it in calls of its own stage's batch size."""
    import ray

    tail = tails(w)
    worker = _push_worker()
    actors = {
        st.name: [
            worker.options(num_cpus=0.05).remote(st.cost, tail[st.name], st.batch_size) for _ in range(st.replicas)
        ]
        for st in w.stages
    }
    await asyncio.gather(*(a.ping.remote() for group in actors.values() for a in group))
    counters = {st.name: 0 for st in w.stages}
    used: dict[str, set[int]] = {st.name: set() for st in w.stages}
    batches = [list(b) for b in push_batches(w.samples, w.stages[0].batch_size)]

    async def call(stage: str, ids: list[int]) -> None:
        r = push_replica(counters[stage], len(actors[stage]))
        counters[stage] += 1
        used[stage].add(r)
        await actors[stage][r].work.remote(ids)

    async def one(ids: list[int]) -> None:  # a batch keeps its identity through the flow
        done: dict[str, asyncio.Future[None]] = {}
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


async def _after(deps: list[asyncio.Future[None]], coro: Coroutine[Any, Any, None]) -> None:
    await asyncio.gather(*deps)
    await coro


@functools.cache
def _push_worker() -> Any:
    import ray

    @ray.remote
    class PushWorker:
        def __init__(self, cost: StageCost, tail: np.ndarray, batch_size: int) -> None:
            self.cost, self.tail, self.batch_size = cost, tail, batch_size
            sleep_slack()

        def ping(self) -> bool:
            return True

        def work(self, ids: list[int]) -> int:
            nominal_sleep(self.cost.shard_s)  # once a call, as flowrl's Sleeper.begin_shard
            for i in range(0, len(ids), self.batch_size):
                model_sleep(self.cost, self.tail, ids[i : i + self.batch_size])
            return len(ids)

    return PushWorker


class _DataStage:
    """A Ray Data ``map_batches`` stage: sleeps like the workload's stage, stamps who and when."""

    def __init__(self, name: str, cost: StageCost, tail: np.ndarray) -> None:
        import os

        self.name, self.cost, self.tail, self.pid = name, cost, tail, os.getpid()
        sleep_slack()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids, start = batch["id"], time.time()
        nominal_sleep(self.cost.shard_s)  # a map_batches call is one step and one call
        model_sleep(self.cost, self.tail, ids)
        n = len(ids)
        batch[f"{self.name}_actor"] = np.full(n, self.pid)
        batch[f"{self.name}_t0"], batch[f"{self.name}_t1"] = np.full(n, start), np.full(n, time.time())
        return batch


def run_ray_data(w: Workload) -> dict[str, Any]:
    """Ray Data's streaming executor, one actor pool (``concurrency=replicas``) per stage.

    Ray Data runs a chain, so the stages run in flow order (a fan-out runs one branch after
    the other per block). Its actor pools start with each execution, so the makespan is taken
    from its first model call to its last; the whole execution's wall time is reported too.
    """
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    tail = tails(w)
    ds = ray.data.range(w.samples, override_num_blocks=-(-w.samples // w.stages[0].batch_size))
    for st in w.stages:
        ds = ds.map_batches(
            _DataStage,
            fn_constructor_args=(st.name, st.cost, tail[st.name]),
            batch_size=st.batch_size,
            concurrency=st.replicas,
            num_cpus=0.05,
            batch_format="numpy",
        )
    start = time.perf_counter()
    rows = ds.take_all()
    wall = time.perf_counter() - start
    names = [st.name for st in w.stages]
    first = min(float(r[f"{n}_t0"]) for r in rows for n in names)
    last = max(float(r[f"{n}_t1"]) for r in rows for n in names)
    used = {n: len({int(r[f"{n}_actor"]) for r in rows}) for n in names}
    return {"makespan_s": last - first, "wall_s": wall, "replicas_used": used, "samples": len(rows)}


class Noop(Model):
    """A model that does nothing: what is left of a call is the runtime's own cost."""

    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        return {"noop_done": [True] * len(batch)}


async def substrate(replicas: int = 8, calls: int = 400, rounds: int = 3) -> dict[str, float]:
    """flowrl's cost per shard against raw Ray calls to the same replica actors, alternated
    ``rounds`` times (medians), since a busy machine drifts:

    - round trip: a no-op call to a one-replica pool's actor, one at a time, vs flowrl running
      one-sample shards back to back on it (the difference is flowrl's overhead per shard);
    - throughput: ``ray.util.ActorPool`` pinging ``replicas`` actors vs flowrl's no-op
      one-sample shards over the same actors.
    """
    from ray.util import ActorPool

    items = [{"k": i} for i in range(calls)]
    pings = list(range(calls))

    def pool_round(actors: list[Any]) -> float:
        start = time.perf_counter()
        list(ActorPool(actors).map_unordered(lambda a, _: a.ping.remote(), pings))
        return calls / (time.perf_counter() - start)

    async def rtt_round(actor: Any) -> float:
        start = time.perf_counter()
        for _ in range(calls // 4):
            await actor.ping.remote()
        return (time.perf_counter() - start) / (calls // 4)

    async def flow_round(pipe: Any, n: int) -> float:
        start = time.perf_counter()
        await pipe.run(items[:n], fields=["noop_done"])
        return time.perf_counter() - start

    # typed as Model: a flow calls the traced form of the step, which Noop does not declare
    one: Model = Noop("noop", {"num_replicas": 1, "batch_size": 1, "prefetch": 1, "cpus_per_replica": 0.05})
    async with open_pipeline(lambda x: one.forward_step(x)) as pipe:
        await pipe.run(items[:16])
        actor = pipe.replicas_of("noop")[0].ref
        rtt, shard = [], []
        for _ in range(rounds):
            rtt.append(await rtt_round(actor))
            shard.append(await flow_round(pipe, calls // 4) / (calls // 4))
    many: Model = Noop("noop", {"num_replicas": replicas, "batch_size": 1, "prefetch": 1, "cpus_per_replica": 0.05})
    async with open_pipeline(lambda x: many.forward_step(x)) as pipe:
        await pipe.run(items[:16])
        actors = [h.ref for h in pipe.replicas_of("noop")]
        pool, flow = [], []
        for _ in range(rounds):
            pool.append(pool_round(actors))
            flow.append(calls / await flow_round(pipe, calls))
    med = {k: float(np.median(v)) for k, v in {"rtt": rtt, "shard": shard, "pool": pool, "flow": flow}.items()}
    return {
        "round_trip_ms": med["rtt"] * 1e3,
        "shard_ms": med["shard"] * 1e3,
        "overhead_ms": (med["shard"] - med["rtt"]) * 1e3,
        "overhead_over_round_trip": (med["shard"] - med["rtt"]) / med["rtt"],
        "actor_pool_calls_per_s": med["pool"],
        "flowrl_shards_per_s": med["flow"],
        "throughput_ratio": med["flow"] / med["pool"],
    }


def _spin() -> None:
    while True:
        pass


class cpu_hog:  # noqa: N801 (used like a function: ``hog = cpu_hog(2)`` ... ``hog.close()``)
    """``n`` processes spinning on the CPU until ``close()``: a machine busy with other work,
    for flowrl and the baselines alike (they run one after the other under the same hog)."""

    def __init__(self, n: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=_spin, daemon=True) for _ in range(max(0, n))]
        for p in self.procs:
            p.start()

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.join()
        self.procs = []
