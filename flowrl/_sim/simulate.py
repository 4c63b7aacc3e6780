"""A virtual-clock simulator of flowrl's scheduling (sans-IO: no Ray, no sleeping).

It drives the same ``PoolScheduler`` and splitter as the runtime, with simulated replicas
whose call times come from a workload description, so makespan, idle time and shard sizes
for thousands of replicas and 100,000 samples can be predicted in seconds.

A step of ``n`` samples takes ``call_s + n * per_sample_s + max(tail of its samples)``:
fixed cost, per-sample cost, and (as in decoding) the longest sample's long-tailed time; a call
runs one step per micro-batch and pays ``shard_s`` once.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from .._core.checks import at_most, non_negative, positive, struct_types
from .._core.errors import ConfigError
from .._core.scheduling.scheduler import Assignment, PoolScheduler
from .._core.settings.base import Settings
from .._core.settings.config import MAX_PREFETCH
from .bound import makespan_floor

if TYPE_CHECKING:
    from collections.abc import Sequence

INPUT = "input"
# Bounds that keep a simulation finite and in memory: every time is a float64 sum of costs (a
# cost of 1e308 s overflows to inf, then NaN), and the simulator holds arrays and lists of
# samples x stages and replicas x stages. Far beyond any run flowrl schedules.
MAX_SECONDS = 1e9  # about 30 years, per cost term
MAX_SIGMA = 20.0  # a log-normal shape: exp(20 * z) already spans hundreds of orders of magnitude
MAX_SAMPLES = 1 << 24
MAX_REPLICAS = 10_000
MAX_BATCH = 1 << 20


class StageCost(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """Seconds of one step: ``call_s + n * per_sample_s + max over its samples of a tail``. A call
    of several micro-batches (``SimStage.shard_micro_batches``) runs one step per micro-batch, in
    order; it pays ``shard_s`` (the replica's time around its steps: an RPC, moving the shard's
    inputs) and the runtime's cost of a call (``Workload.overhead_s``, ``dispatch_s``) once.

    The tail of a sample is log-normal with median ``tail_median_s`` and shape ``tail_sigma``
    (0: no tail), drawn once per (stage, sample) from the workload's seed.
    """

    call_s: float = 0.0
    per_sample_s: float = 0.0
    tail_median_s: float = 0.0
    tail_sigma: float = 0.0
    shard_s: float = 0.0

    def __post_init__(self) -> None:
        struct_types(self)
        non_negative(
            "StageCost",
            shard_s=self.shard_s,
            call_s=self.call_s,
            per_sample_s=self.per_sample_s,
            tail_median_s=self.tail_median_s,
            tail_sigma=self.tail_sigma,
        )
        at_most(
            "StageCost",
            MAX_SECONDS,
            "seconds; the simulator's sums must stay finite",
            shard_s=self.shard_s,
            call_s=self.call_s,
            per_sample_s=self.per_sample_s,
            tail_median_s=self.tail_median_s,
        )
        at_most("StageCost", MAX_SIGMA, "a log-normal shape; the tails must stay finite", tail_sigma=self.tail_sigma)


class SimStage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    name: str
    replicas: int
    batch_size: int
    inputs: list[str] = msgspec.field(default_factory=lambda: [INPUT])
    cost: StageCost = msgspec.field(default_factory=StageCost)
    splitter: str = "cost"
    prefetch: int = 2  # as ModelConfig's
    shard_micro_batches: int = 8  # as ModelConfig's: the most micro-batches of a ``cost`` shard

    def __post_init__(self) -> None:
        struct_types(self)
        at_most("SimStage", MAX_REPLICAS, "the simulator keeps a list per replica", replicas=self.replicas)
        at_most("SimStage", MAX_BATCH, "samples per call", batch_size=self.batch_size * self.shard_micro_batches)
        at_most(
            "SimStage", MAX_PREFETCH, "shards in flight per replica, as ModelConfig.prefetch", prefetch=self.prefetch
        )


class Workload(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """Stages in flow order (each reads ``input`` or earlier stages), samples, seed, and the
    runtime's cost per call (0 for the zero-overhead yardstick).

    ``overhead_s``: a call's latency beyond its step (every call pays it, in parallel).
    ``dispatch_s``: the runtime's capacity: each call holds one shared dispatcher (the
    driver, or a small machine's CPUs) that long before it is sent, so no more than
    ``1 / dispatch_s`` calls a second go out however many replicas wait. With many replicas
    and short calls this, not the replicas, sets the makespan.

    ``group``: samples per prompt (a GRPO group: consecutive samples share their prompt's
    time); ``epoch``: which pass over the prompts this is; ``epoch_noise``: the log-normal shape
    of how much a sample's time varies from epoch to epoch around its prompt's (0: the same
    every epoch). A prompt's time is the same in every epoch but for that noise, as the length
    of a prompt's responses is in RL (see ``simulate(costs=...)`` for what a memory predicts).

    ``warm``: the ``cost`` splitter starts from each stage's nominal cost (as after a warm-up
    run, or with ``ModelConfig.call_cost``) instead of learning it during the run.

    ``cost_hint_sigma``: when set, every sample carries an estimate of its cost (as with
    ``PipelineConfig.cost_field``): the first stage's tail times a log-normal error of that
    shape (0: exact estimates).

    ``tail_s``: per stage, each sample's tail seconds as measured (a generation's time beyond
    the call's fixed and per-sample cost), in place of the ones drawn from the stage's cost:
    to predict a run whose samples are known.
    """

    stages: list[SimStage]
    samples: int
    seed: int = 0
    overhead_s: float = 0.0
    dispatch_s: float = 0.0
    cost_hint_sigma: float | None = None
    warm: bool = True
    group: int = 1
    epoch: int = 0
    epoch_noise: float = 0.0
    tail_s: dict[str, list[float]] | None = None

    def __post_init__(self) -> None:
        items = self.stages if isinstance(self.stages, list) else []
        odd = next((st for st in items if not isinstance(st, SimStage)), None)
        if odd is not None:  # named before the type walk, whose message would be about a missing field
            raise ConfigError(f"Workload.stages: expected SimStage items, got a {type(odd).__name__}")
        struct_types(self)
        if not self.stages or self.samples <= 0:
            raise ConfigError(
                f"Workload needs at least one stage and samples > 0, got {len(self.stages)} stage(s) and "
                f"samples={self.samples}"
            )
        seen = {INPUT}
        for st in self.stages:
            if st.name in seen:
                raise ConfigError(f"Workload.stages: two stages are named {st.name!r}; stage names must be unique")
            missing = [i for i in st.inputs if i not in seen]
            if missing:
                raise ConfigError(f"stage {st.name!r} reads {missing}, which no earlier stage (or 'input') is")
            bad = {
                k: v
                for k, v in (
                    ("replicas", st.replicas),
                    ("batch_size", st.batch_size),
                    ("prefetch", st.prefetch),
                    ("shard_micro_batches", st.shard_micro_batches),
                )
                if v <= 0
            }
            if bad:
                raise ConfigError(f"stage {st.name!r}: {', '.join(bad)} must be > 0, got {bad}")
            seen.add(st.name)
        # numpy's generators take no negative seed
        non_negative("Workload", seed=self.seed, epoch=self.epoch, epoch_noise=self.epoch_noise)
        positive("Workload", group=self.group)
        at_most("Workload", MAX_SIGMA, "a log-normal shape", epoch_noise=self.epoch_noise)
        at_most("Workload", MAX_SAMPLES, "the simulator keeps arrays of samples x stages", samples=self.samples)
        seconds = "seconds; the simulator's sums must stay finite"
        at_most("Workload", MAX_SECONDS, seconds, overhead_s=self.overhead_s, dispatch_s=self.dispatch_s)
        at_most("Workload", MAX_SIGMA, "a log-normal shape", cost_hint_sigma=self.cost_hint_sigma)
        negative = {k: v for k, v in (("overhead_s", self.overhead_s), ("dispatch_s", self.dispatch_s)) if v < 0}
        if negative:
            raise ConfigError(f"Workload: {', '.join(negative)} must be >= 0, got {negative}")
        _given_tails(self)
        if self.cost_hint_sigma is not None and self.cost_hint_sigma < 0:
            raise ConfigError(
                f"Workload.cost_hint_sigma must be >= 0 (or None: no estimates), got {self.cost_hint_sigma}"
            )


class SimResult(msgspec.Struct, frozen=True, kw_only=True):
    makespan_s: float
    lower_bound_s: float
    busy_s: dict[str, list[float]]  # per stage, per replica
    replicas_used: dict[str, int]
    calls: dict[str, int]
    shard_sizes: dict[str, dict[int, int]]  # per stage: size -> count

    @property
    def ratio(self) -> float:
        """Makespan over the strict lower bound (1.0 is perfect)."""
        return self.makespan_s / self.lower_bound_s if self.lower_bound_s else 1.0

    def idle_fraction(self, stage: str) -> float:
        if stage not in self.busy_s:
            raise ConfigError(f"idle_fraction: no stage {stage!r}; the stages are {sorted(self.busy_s)}")
        busy = self.busy_s[stage]
        return 1.0 - sum(busy) / (len(busy) * self.makespan_s) if self.makespan_s else 0.0


def _given_tails(w: Workload) -> None:
    """``tail_s`` names stages of the workload, one finite time >= 0 per sample."""
    names = {st.name for st in w.stages}
    for name, times in (w.tail_s or {}).items():
        if name not in names:
            raise ConfigError(f"Workload.tail_s names stage {name!r}; the stages are {sorted(names)}")
        if len(times) != w.samples:
            raise ConfigError(
                f"Workload.tail_s[{name!r}]: expected one time per sample ({w.samples}), got {len(times)}"
            )
        bad = [t for t in times if not 0.0 <= t <= MAX_SECONDS]
        if bad:
            raise ConfigError(f"Workload.tail_s[{name!r}]: times must be seconds in [0, {MAX_SECONDS:g}], got {bad[0]}")


def tails(workload: Workload) -> dict[str, np.ndarray]:
    """Each stage's per-sample tail times in ``workload.epoch``, deterministic from the seed: a
    prompt's own time (shared by the ``group`` samples of a prompt, the same every epoch),
    times an epoch's noise (``epoch_noise``: a log-normal shape, 0 for none)."""
    w, out = workload, {}
    prompts = -(-w.samples // w.group)
    for k, st in enumerate(w.stages):
        rng = np.random.default_rng([w.seed, k])
        c = st.cost
        base = (
            c.tail_median_s * rng.lognormal(0.0, c.tail_sigma, prompts)
            if c.tail_median_s > 0 and c.tail_sigma > 0
            else np.full(prompts, c.tail_median_s)
        )
        tail = np.repeat(base, w.group)[: w.samples]
        if w.epoch_noise > 0 and c.tail_median_s > 0:
            tail = tail * np.random.default_rng([w.seed, k, 1 << 16, w.epoch]).lognormal(0.0, w.epoch_noise, w.samples)
        out[st.name] = tail
    for name, given in (w.tail_s or {}).items():
        out[name] = np.asarray(given, dtype=np.float64)
    return out


def cost_hints(workload: Workload, tail: dict[str, np.ndarray]) -> np.ndarray | None:
    """Each sample's cost estimate, or None when the workload gives none."""
    sigma = workload.cost_hint_sigma
    if sigma is None:
        return None
    noise = np.random.default_rng([workload.seed, 1 << 20]).lognormal(0.0, sigma, workload.samples) if sigma else 1.0
    return tail[workload.stages[0].name] * noise


def lower_bound(workload: Workload, tail: dict[str, np.ndarray]) -> float:
    """A makespan no schedule can beat (``makespan_floor``): the busiest stage's least possible
    work per replica, and the slowest sample's path (each stage with a call of its own)."""
    pools, path = [], {INPUT: np.zeros(workload.samples)}
    for st in workload.stages:
        c, t = st.cost, tail[st.name]
        # each replica makes one call at least (its shard_s); a sample's path, a call of its own
        pools.append((least_work(c, t, st.batch_size) + st.replicas * c.shard_s, st.replicas))
        start = np.max([path[i] for i in st.inputs], axis=0)
        path[st.name] = start + c.shard_s + c.call_s + c.per_sample_s + t
    return makespan_floor((float(p.max()) for p in path.values()), pools)


def least_work(cost: StageCost, tail: np.ndarray, batch_size: int) -> float:
    """The least total step time of a stage over all ways to cut its samples into steps of at
    most ``batch_size`` (however the steps are grouped into calls): a step lasts as long as its
    longest sample, so the cheapest cut knows every sample's time, sorts them and fills full
    steps of similar samples (a shard policy, which cannot know them, pays more)."""
    longest = np.sort(tail)[::-1][::batch_size]  # the longest sample of each sorted full step
    return len(longest) * cost.call_s + len(tail) * cost.per_sample_s + float(longest.sum())


def _prior(st: SimStage, tail: np.ndarray) -> tuple[float, float] | None:
    """What a warm ``cost`` splitter knows of a stage: its fixed time, and a sample's time with
    the mean tail (a call's tail is its longest sample's, so this is a sample's share)."""
    c = st.cost
    per = c.per_sample_s + float(tail.mean())
    return (c.call_s, per) if c.call_s or per else None


def simulate(workload: Workload, costs: Sequence[float] | np.ndarray | None = None) -> SimResult:
    """The workload's makespan and more on a virtual clock; ``costs``: an estimate of each
    sample's cost handed to the scheduler (as ``AsyncPipeline.run(costs=...)``), in place of
    ``cost_hint_sigma``'s."""
    if not isinstance(workload, Workload):
        raise ConfigError(f"simulate: expected a flowrl.Workload, got {type(workload).__name__}")
    hints = None if costs is None else np.asarray(costs, dtype=np.float64)
    if hints is not None and hints.shape != (workload.samples,):
        raise ConfigError(f"simulate(costs=...): expected one cost per sample ({workload.samples}), got {hints.shape}")
    sim = _Sim(workload, hints)
    sim.run()
    return sim.result()


class _Sim:
    def __init__(self, w: Workload, hints: np.ndarray | None = None) -> None:
        self.w = w
        self.tail = tails(w)
        self.hints = cost_hints(w, self.tail) if hints is None else hints
        self.pools = {}
        for st in w.stages:
            pool = PoolScheduler(replicas=st.replicas, policy=st.splitter, prefetch=st.prefetch, clock=self._now)
            prior = _prior(st, self.tail[st.name]) if w.warm else None
            pool.add_stage(st.name, st.batch_size, prior, st.shard_micro_batches)
            pool.expect(st.name, w.samples)
            pool.admit(st.name, w.samples)
            self.pools[st.name] = pool
        self.stage = {st.name: st for st in w.stages}
        self.consumers = {name: [st for st in w.stages if name in st.inputs] for name in [INPUT, *self.stage]}
        self.done = {name: np.zeros(w.samples, dtype=bool) for name in self.stage}
        self.free_at = {st.name: [0.0] * st.replicas for st in w.stages}
        self.busy = {st.name: [0.0] * st.replicas for st in w.stages}
        self.sizes: dict[str, Counter[int]] = {st.name: Counter() for st in w.stages}
        # (end, seq, stage, shard, duration, overhead seen, each step's (samples, seconds))
        self.events: list[tuple[float, int, str, Assignment, float, float | None, list[tuple[int, float]]]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.dispatcher_free = 0.0  # when the shared dispatcher can send the next call

    def run(self) -> None:
        ids = list(range(self.w.samples))
        for st in self.consumers[INPUT]:
            if st.inputs == [INPUT]:
                self.pools[st.name].ready(st.name, ids, self._costs(ids))
        for st in self.w.stages:
            for r in range(st.replicas):
                for _ in range(st.prefetch):
                    self.pools[st.name].request(r)
        self._dispatch(self.w.stages)
        while self.events:
            self.now, _, name, a, duration, overhead, steps = heapq.heappop(self.events)
            self._finish(name, a, duration, overhead, steps)

    def _now(self) -> float:
        return self.now

    def _costs(self, ids: list[int]) -> list[float] | None:
        return None if self.hints is None else self.hints[ids].tolist()

    def _dispatch(self, stages: list[SimStage]) -> None:
        for st in stages:
            for a in self.pools[st.name].poll():
                self._start(st, a)

    def _start(self, st: SimStage, a: Assignment) -> None:
        c, n = st.cost, len(a.ids)
        tail = self.tail[st.name][a.ids]  # a step lasts as long as its longest sample
        steps = [
            (len(part), c.call_s + len(part) * c.per_sample_s + float(part.max()))
            for part in (tail[lo : lo + st.batch_size] for lo in range(0, n, st.batch_size))
        ]
        duration = c.shard_s + sum(seconds for _, seconds in steps)
        sent = self.now
        if self.w.dispatch_s:
            sent = self.dispatcher_free = max(sent, self.dispatcher_free) + self.w.dispatch_s
        queued = self.free_at[st.name][a.replica] > sent  # behind another shard of its replica
        # One call at a time; the overhead is the trip to the replica, which a shard queued
        # behind another makes while that one runs.
        begin = max(sent + self.w.overhead_s, self.free_at[st.name][a.replica])
        end = begin + duration
        self.free_at[st.name][a.replica] = end
        self.busy[st.name][a.replica] += duration
        self.sizes[st.name][n] += 1
        # what the runtime would measure as the call's overhead (unknown when it queued)
        overhead = None if queued else begin - self.now
        heapq.heappush(self.events, (end, next(self.seq), st.name, a, duration, overhead, steps))

    def _finish(
        self, name: str, a: Assignment, duration: float, overhead: float | None, steps: list[tuple[int, float]]
    ) -> None:
        pool = self.pools[name]
        pool.finish(a)
        # as the runtime does with each call
        pool.measure(name, len(a.ids), duration, overhead, steps, self.stage[name].cost.shard_s, a.replica)
        self.done[name][a.ids] = True
        touched = [self.stage[name]]
        for st in self.consumers[name]:
            ready = [i for i in a.ids if all(x == INPUT or self.done[x][i] for x in st.inputs)]
            if ready:
                self.pools[st.name].ready(st.name, ready, self._costs(ready))
                touched.append(st)
        pool.request(a.replica)
        self._dispatch(touched)

    def result(self) -> SimResult:
        makespan = max((max(f) for f in self.free_at.values()), default=0.0)
        return SimResult(
            makespan_s=makespan,
            lower_bound_s=lower_bound(self.w, self.tail),
            busy_s={k: list(v) for k, v in self.busy.items()},
            replicas_used={k: sum(1 for b in v if b > 0) for k, v in self.busy.items()},
            calls={k: sum(v.values()) for k, v in self.sizes.items()},
            shard_sizes={k: dict(sorted(v.items())) for k, v in self.sizes.items()},
        )
