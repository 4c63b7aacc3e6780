"""Exact per-stage and per-replica accounting (sans-IO)."""

from __future__ import annotations

from collections import Counter, deque
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..settings.config import CallMeta


class ReplicaStats(msgspec.Struct, frozen=True, kw_only=True):
    """One replica's share of one stage. ``idle_s`` is pool-wide: time the replica ran no stage."""

    replica: int
    samples: int
    calls: int
    busy_s: float
    idle_s: float
    max_shard: int
    out_bytes: int = 0
    overhead_s: float = 0.0
    starved_s: float = 0.0  # pool-wide: time the replica had no shard and waited for one


class StageStats(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    model: str
    samples: int
    calls: int
    busy_s: float
    max_shard: int
    replicas: list[ReplicaStats]
    shard_sizes: dict[int, int] = {}  # shard size -> calls
    out_bytes: int = 0  # about how many bytes of new fields the stage produced
    # Seconds the calls took, seen from the driver, beyond their busy time: transport, the
    # wait behind a shard queued first on the replica (prefetch > 1), the runtime's own work.
    overhead_s: float = 0.0
    retried: int = 0  # samples sent to the stage again after their replica died (not in samples)
    dropped: int = 0  # samples dropped here once their retries were spent (ModelConfig.on_spent="drop")
    queued: int = 0  # samples ready for the stage that no replica has taken yet
    queue_peak: int = 0  # the most that ever waited so


class LoopStats(msgspec.Struct, frozen=True, kw_only=True):
    """A loop's samples that left it: how many, the turns they ran (in all, and how many
    samples ran each number of turns) and why they left (``done``, ``max_turns``, ``deadline``)."""

    name: str
    samples: int = 0
    turns: int = 0
    turn_counts: dict[int, int] = {}
    stops: dict[str, int] = {}


class DroppedSample(msgspec.Struct, frozen=True, kw_only=True):
    """A sample dropped once its retries on ``stage`` were spent (``ModelConfig.on_spent="drop"``):
    its id, its turn of the stage's loop (0 outside loops) and why its last call failed."""

    sample: int
    stage: str
    turn: int
    reason: str


MAX_DROPPED_KEPT = 1000  # the latest dropped samples PipelineStats lists (each stage counts them all)


class PipelineStats(msgspec.Struct, frozen=True, kw_only=True):
    """Counters since the pipeline opened; ``active_s`` is the time spent inside runs;
    ``blocked_s`` the time admission waited for room in the in-flight window (``max_inflight``:
    the caller, or stages downstream, held every place). ``serving``: replicas serving now, per
    model (pools grow and shrink: ``resize``, ``ModelConfig.autoscale``). ``dropped``: the latest
    samples dropped after their retries (at most ``MAX_DROPPED_KEPT``; ``StageStats.dropped``
    counts them all)."""

    active_s: float
    stages: dict[str, StageStats]
    blocked_s: float = 0.0
    serving: dict[str, int] = {}
    loops: dict[str, LoopStats] = {}
    dropped: list[DroppedSample] = []

    def __getitem__(self, stage: str) -> StageStats:
        return self.stages[stage]


class _Cell:
    __slots__ = ("samples", "calls", "busy_s", "out_bytes", "sizes", "overhead_s")

    def __init__(self) -> None:
        self.samples = self.calls = self.out_bytes = 0
        self.busy_s = self.overhead_s = 0.0
        self.sizes: Counter[int] = Counter()


class StatsRecorder:
    def __init__(self, stage_models: Mapping[str, str], replicas: Mapping[str, int]) -> None:
        self._stage_models = dict(stage_models)
        self._replicas = dict(replicas)
        self._cells = {(s, r): _Cell() for s, m in self._stage_models.items() for r in range(self._replicas[m])}
        self._model_busy = {(m, r): 0.0 for m, n in self._replicas.items() for r in range(n)}
        self._retried = Counter[str]()
        self._dropped: deque[DroppedSample] = deque(maxlen=MAX_DROPPED_KEPT)
        self._dropped_at = Counter[str]()
        self._starved = {(m, r): 0.0 for m, n in self._replicas.items() for r in range(n)}
        self.active_s = 0.0
        self.blocked_s = 0.0
        self._serving: dict[tuple[str, int], tuple[float, float | None]] = {}  # replicas added or removed
        self._loops: dict[str, tuple[Counter[int], Counter[str]]] = {}  # loop -> (turn counts, stops)

    def add_replica(self, model: str, replica: int, active_s: float) -> None:
        """``replica`` joins ``model``'s pool after ``active_s`` of runs: counters for it (and
        for any id below it not seen yet, whose replica is still starting or never started);
        its idle time counts from now."""
        for r in range(self._replicas[model], replica + 1):
            for stage, m in self._stage_models.items():
                if m == model:
                    self._cells[(stage, r)] = _Cell()
            self._model_busy[(model, r)] = self._starved[(model, r)] = 0.0
            self._serving[(model, r)] = (active_s, active_s)  # not in the pool (yet)
        self._replicas[model] = max(self._replicas[model], replica + 1)
        self._serving[(model, replica)] = (active_s, None)

    def remove_replica(self, model: str, replica: int, active_s: float) -> None:
        """``replica`` left the pool after ``active_s`` of runs: its idle time stops there."""
        joined, _ = self._serving.get((model, replica), (0.0, None))
        self._serving[(model, replica)] = (joined, active_s)

    def starved_s(self, model: str) -> float:
        """Seconds ``model``'s replicas had no shard, closed intervals only."""
        return sum(v for (m, _), v in self._starved.items() if m == model)

    def starved(self, model: str, replica: int, seconds: float) -> None:
        self._starved[(model, replica)] += seconds

    def retried(self, stage: str, samples: int) -> None:
        self._retried[stage] += samples

    def dropped(self, stage: str, samples: list[int], turns: list[int], reason: str) -> None:
        """``samples`` were dropped on ``stage`` (their retries spent), in these turns of its loop."""
        self._dropped_at[stage] += len(samples)
        for sid, turn in zip(samples, turns, strict=True):
            self._dropped.append(DroppedSample(sample=sid, stage=stage, turn=turn, reason=reason))

    def record(self, stage: str, replica: int, meta: CallMeta, latency_s: float) -> None:
        cell = self._cells[(stage, replica)]
        cell.overhead_s += max(0.0, latency_s - meta.busy_s)
        cell.samples += meta.rows
        cell.calls += 1
        cell.busy_s += meta.busy_s
        cell.out_bytes += meta.out_bytes
        cell.sizes[meta.rows] += 1
        self._model_busy[(self._stage_models[stage], replica)] += meta.busy_s

    def left_loop(self, loop: str, turns: int, stop: str) -> None:
        """A sample left ``loop`` after ``turns`` turns, for reason ``stop``."""
        counts, stops = self._loops.setdefault(loop, (Counter(), Counter()))
        counts[turns] += 1
        stops[stop] += 1

    def add_active(self, seconds: float) -> None:
        self.active_s += seconds

    def snapshot(
        self,
        extra_active_s: float = 0.0,
        queues: Mapping[str, tuple[int, int]] | None = None,
        serving: Mapping[str, int] | None = None,
        starving: Mapping[tuple[str, int], float] | None = None,
    ) -> PipelineStats:
        active = self.active_s + extra_active_s
        queues, starving = queues or {}, starving or {}
        stages = {}
        for stage, model in self._stage_models.items():
            reps = [
                self._replica(stage, model, r, active, starving.get((model, r), 0.0))
                for r in range(self._replicas[model])
            ]
            sizes = sum((self._cells[(stage, r)].sizes for r in range(self._replicas[model])), Counter())
            stages[stage] = StageStats(
                name=stage,
                model=model,
                samples=sum(r.samples for r in reps),
                calls=sum(r.calls for r in reps),
                busy_s=sum(r.busy_s for r in reps),
                max_shard=max((r.max_shard for r in reps), default=0),
                replicas=reps,
                shard_sizes=dict(sorted(sizes.items())),
                out_bytes=sum(r.out_bytes for r in reps),
                overhead_s=sum(r.overhead_s for r in reps),
                retried=self._retried[stage],
                dropped=self._dropped_at[stage],
                queued=queues.get(stage, (0, 0))[0],
                queue_peak=queues.get(stage, (0, 0))[1],
            )
        loops = {
            name: LoopStats(
                name=name,
                samples=sum(counts.values()),
                turns=sum(k * n for k, n in counts.items()),
                turn_counts=dict(sorted(counts.items())),
                stops=dict(sorted(stops.items())),
            )
            for name, (counts, stops) in self._loops.items()
        }
        return PipelineStats(
            active_s=active,
            stages=stages,
            blocked_s=self.blocked_s,
            serving=dict(serving or {}),
            loops=loops,
            dropped=list(self._dropped),
        )

    def _replica(self, stage: str, model: str, r: int, active: float, starving: float) -> ReplicaStats:
        cell = self._cells[(stage, r)]
        joined, left = self._serving.get((model, r), (0.0, None))
        served = (active if left is None else min(active, left)) - joined  # the run time it was in the pool
        idle = max(0.0, served - self._model_busy[(model, r)])
        return ReplicaStats(
            replica=r,
            samples=cell.samples,
            calls=cell.calls,
            busy_s=cell.busy_s,
            idle_s=idle,
            max_shard=max(cell.sizes, default=0),
            out_bytes=cell.out_bytes,
            overhead_s=cell.overhead_s,
            starved_s=self._starved[(model, r)] + starving,
        )
