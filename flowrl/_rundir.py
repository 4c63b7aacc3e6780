"""A run's directory (layer 6): what an engine writes for people and tools to read.

``metrics.jsonl``: one JSON object per episode (its ``EpisodeStats``, the trainers' and the
rollout pipeline's counters so far, the wall-clock time); ``trace.json``: the timeline of every
replica, trainer rank and episode phase as a Chrome trace (``flowrl trace RUN_DIR`` renders it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from ._engine_parts import EngineStats
from ._trace import Span, chrome_trace, write_json

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
        }
        with open(self.path / METRICS, "ab") as f:
            f.write(msgspec.json.encode(line) + b"\n")

    def trace(self, spans: list[Span]) -> Path:
        return write_json(self.path / TRACE, chrome_trace(spans))
