"""What an engine counts: the stats Structs ``learn()`` returns, and the trainers'
per-rank counters behind them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import msgspec

from .._core.observe.pipeline_stats import PipelineStats
from .._core.scheduling.autoscale import ScaleEvent

if TYPE_CHECKING:
    from collections.abc import Iterable

Counts = dict[str, dict[int, list[float]]]  # trainer -> rank -> [samples, steps, busy s]


class RankStats(msgspec.Struct, frozen=True, kw_only=True):
    rank: int
    samples: int
    steps: int
    busy_s: float


class TrainerStats(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    samples: int
    steps: int
    ranks: list[RankStats]


class EpisodeStats(msgspec.Struct, frozen=True, kw_only=True):
    """One episode: its phases' seconds, mean train metrics per trainer, weight versions after it.

    ``staleness``: per synced inference model, how many weight versions behind the one its
    replicas held at training time each trained sample was generated (versions -> samples;
    above 0 for samples a relay function brings back from earlier episodes, and with
    ``staleness.max`` > 0). ``wait_s``: how long training waited for this episode's rollout
    (all of ``rollout_s`` when synchronous). ``dropped`` / ``regenerated``: samples over the
    staleness bound (``staleness.on_stale``). ``failed``: samples of the rollout the pipeline dropped once
    their retries were spent (``ModelConfig.on_spent="drop"``; nothing trains on them).
    Samples generated in a loop count by their oldest segment (``RunConfig.staleness.segment``);
    ``segment_staleness`` counts every segment.
    """

    episode: int
    samples: int
    rollout_s: float
    train_s: float
    sync_s: float
    eval_s: float
    metrics: dict[str, dict[str, float]]
    weight_versions: dict[str, int]
    staleness: dict[str, dict[int, int]] = {}
    segment_staleness: dict[str, dict[int, int]] = {}  # the same per segment of a partial rollout (loops)
    turns: dict[str, dict[int, int]] = {}  # per loop of the rollout: how many samples ran how many turns
    wait_s: float = 0.0
    dropped: int = 0
    regenerated: int = 0
    failed: int = 0


class Rebuild(msgspec.Struct, frozen=True, kw_only=True):
    """A trainer whose rank died, started again. ``source`` ``"checkpoint"``: from the
    checkpoint of ``episode``, the episodes done since run again (``redone``); ``"survivor"``:
    from a surviving rank's state during episode ``episode``, only the broken step run again
    (``redone`` 0). ``seconds``: from the death noticed to the ranks started again, restored and
    every synced model holding the weights it should; the work run again is not in it."""

    trainer: str
    rank: int
    episode: int
    redone: int
    seconds: float
    source: Literal["checkpoint", "survivor"] = "checkpoint"


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """``rebuilds``: this process's trainer rebuilds; ``replaced``: the rollout pools'
    replacements of replicas that died or hung (``grow`` events with their ``recovery_s``).
    Neither is carried by a checkpoint: a resumed run starts with none."""

    rollout: PipelineStats | None
    evaluation: PipelineStats | None
    trainers: dict[str, TrainerStats]
    episodes: list[EpisodeStats]
    rebuilds: list[Rebuild] = []
    replaced: list[ScaleEvent] = []


class TrainCounters:
    """Per trainer and rank: samples trained, steps, busy seconds. A checkpoint carries them, so
    that a resumed run reports what the uninterrupted one would."""

    def __init__(self, trainers: Iterable[str]) -> None:
        self._counts: Counts = {name: {} for name in trainers}

    def add(self, trainer: str, rank: int, samples: int, busy_s: float) -> None:
        c = self._counts[trainer].setdefault(rank, [0, 0, 0.0])
        c[0], c[1], c[2] = c[0] + samples, c[1] + 1, c[2] + busy_s

    def stats(self) -> dict[str, TrainerStats]:
        out = {}
        for name, ranks in self._counts.items():
            per_rank = [
                RankStats(rank=r, samples=int(v[0]), steps=int(v[1]), busy_s=v[2]) for r, v in sorted(ranks.items())
            ]
            out[name] = TrainerStats(
                model=name,
                samples=sum(r.samples for r in per_rank),
                steps=max((r.steps for r in per_rank), default=0),
                ranks=per_rank,
            )
        return out

    def snapshot(self) -> Counts:
        return {name: {r: list(v) for r, v in c.items()} for name, c in self._counts.items()}

    def restore(self, counts: Counts) -> None:
        # a checkpoint read from JSON may give the ranks as strings
        self._counts = {name: {int(r): list(v) for r, v in c.items()} for name, c in counts.items()}


def mean_metrics(steps: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Numeric metrics averaged over steps and ranks, each rank weighted by its samples."""
    sums: dict[str, list[float]] = {}
    for step in steps:
        for rank in step:
            weight = rank.pop("_samples", 1)
            for k, v in rank.items():
                if weight and not k.startswith("_") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    acc = sums.setdefault(k, [0.0, 0.0])
                    acc[0] += float(v) * weight
                    acc[1] += weight
    return {k: total / count for k, (total, count) in sums.items() if count}
