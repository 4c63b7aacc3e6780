"""What an engine reports: its run directory, and metrics for Ray's Prometheus export.

``metrics.jsonl``: one JSON object per episode (its ``EpisodeStats``, the trainers' and the
rollout pipeline's counters so far, the wall-clock time); ``trace.json``: the timeline of every
replica, trainer rank and episode phase as a Chrome trace (``flowrl trace RUN_DIR`` renders it).
``metric_values``: the same counters as gauges (``flowrl_*``; Ray prefixes ``ray_``), which the
Ray backend exports through ``ray.util.metrics`` after every episode.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from .._core.trace import Span, chrome_trace, write_json

if TYPE_CHECKING:
    from .._core.stats import PipelineStats
    from .stats import EngineStats, EpisodeStats, TrainerStats

METRICS, TRACE = "metrics.jsonl", "trace.json"


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    def episode(self, stats: EngineStats) -> None:
        """Append the last episode of ``stats`` to ``metrics.jsonl``."""
        line: dict[str, Any] = {
            **msgspec.to_builtins(stats.episodes[-1]),
            "time": time.time(),
            "trainers": msgspec.to_builtins(stats.trainers),
            "rollout": msgspec.to_builtins(stats.rollout.stages) if stats.rollout is not None else {},
            "rollout_blocked_s": stats.rollout.blocked_s if stats.rollout is not None else 0.0,
            "rollout_serving": stats.rollout.serving if stats.rollout is not None else {},
        }
        with open(self.path / METRICS, "ab") as f:
            f.write(msgspec.json.encode(line) + b"\n")

    def trace(self, spans: list[Span]) -> Path:
        return write_json(self.path / TRACE, chrome_trace(spans))


Metric = tuple[str, str, dict[str, str], float]  # name, description, tags, value


def metric_values(stats: EngineStats) -> list[Metric]:
    """The engine's counters after its last episode, as gauges."""
    if not stats.episodes:
        return []
    last = stats.episodes[-1]
    out = _episode_gauges(last) + _trainer_gauges(stats.trainers) + _stale_gauges(last)
    return out + (_rollout_gauges(stats.rollout) if stats.rollout is not None else [])


def _episode_gauges(last: EpisodeStats) -> list[Metric]:
    phase = "seconds of each phase in the last episode"
    out: list[Metric] = [("flowrl_episodes", "episodes done", {}, float(last.episode + 1))]
    out += [
        ("flowrl_phase_seconds", phase, {"phase": p}, float(getattr(last, f"{p}_s")))
        for p in ("rollout", "train", "sync", "eval")
    ]
    version = "weight version an inference model runs"
    out += [("flowrl_weight_version", version, {"model": m}, float(v)) for m, v in last.weight_versions.items()]
    lag = "most versions behind of a sample trained in the last episode"
    out += [("flowrl_staleness_max", lag, {"model": m}, float(max(lags))) for m, lags in last.staleness.items()]
    return out


def _trainer_gauges(trainers: dict[str, TrainerStats]) -> list[Metric]:
    out: list[Metric] = []
    for name, trainer in trainers.items():
        out.append(("flowrl_trainer_steps", "optimizer steps of a trainer", {"trainer": name}, float(trainer.steps)))
        out.append(
            ("flowrl_trainer_samples", "samples a trainer trained on", {"trainer": name}, float(trainer.samples))
        )
    return out


def _stale_gauges(last: EpisodeStats) -> list[Metric]:
    wait = "seconds training waited for the last episode's rollout"
    out: list[Metric] = [("flowrl_rollout_wait_seconds", wait, {}, float(last.wait_s))]
    out += [
        (
            f"flowrl_stale_{kind}",
            f"samples over the staleness bound {kind} in the last episode",
            {},
            float(getattr(last, kind)),
        )
        for kind in ("dropped", "regenerated")
    ]
    return out


def _rollout_gauges(rollout: PipelineStats) -> list[Metric]:
    serving = "replicas serving in a rollout pool"
    out: list[Metric] = [("flowrl_pool_replicas", serving, {"model": m}, float(n)) for m, n in rollout.serving.items()]
    blocked = "seconds admission waited for room in the in-flight window"
    out.append(("flowrl_rollout_blocked_seconds", blocked, {}, rollout.blocked_s))
    for stage, s in rollout.stages.items():
        tags = {"stage": stage, "model": s.model}
        out.append(("flowrl_stage_samples", "samples a rollout stage completed", tags, float(s.samples)))
        out.append(("flowrl_stage_busy_seconds", "seconds a stage's replicas were busy", tags, s.busy_s))
        out.append(("flowrl_stage_retried", "samples sent to a stage again", tags, float(s.retried)))
        out.append(("flowrl_stage_queued", "samples ready for a stage that no replica took yet", tags, float(s.queued)))
        out.append(("flowrl_stage_queue_peak", "the most samples that waited for a stage", tags, float(s.queue_peak)))
        for r in s.replicas:
            rtags = {**tags, "replica": str(r.replica)}
            out.append(("flowrl_replica_busy_seconds", "seconds a replica was busy on a stage", rtags, r.busy_s))
            out.append(("flowrl_replica_idle_seconds", "seconds a replica ran no stage", rtags, r.idle_s))
            starved = "seconds a replica had no shard and waited for one"
            out.append(("flowrl_replica_starved_seconds", starved, rtags, r.starved_s))
    return out
