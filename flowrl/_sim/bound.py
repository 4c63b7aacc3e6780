"""The rule every simulator's lower bound follows (sans-IO): no schedule ends before the slowest
sample's own way through the flow, with a call of its own at each step, nor before the busiest
pool has done the least work it can do, spread evenly over all of its replicas."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable


def makespan_floor(paths: Iterable[float], pools: Iterable[tuple[float, int]]) -> float:
    """``paths``: each sample's time alone through the flow; ``pools``: per pool, (the least total
    time its calls can take, its replicas)."""
    return max(max(paths, default=0.0), max((work / replicas for work, replicas in pools), default=0.0))
