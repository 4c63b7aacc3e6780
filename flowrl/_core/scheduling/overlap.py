"""A replica's busy seconds when its calls overlap: a model that merges shards (``Model.merges_shards``,
e.g. an inference engine's continuous batching) runs several of its calls at once."""

from __future__ import annotations

import itertools


class BusyClock:
    """Charges each call the part of its time that no call charged before it was charged for, so
    that the calls' busy seconds add up to the time the replica was busy (the union of their
    intervals), however they overlap and in whatever order they end.

    Not thread-safe: the caller holds a lock around ``begin`` and ``end``."""

    def __init__(self) -> None:
        self._open: dict[int, float] = {}  # call -> its start
        self._spans: list[tuple[float, float]] = []  # charged already: disjoint, sorted
        self._ids = itertools.count()

    def begin(self, at: float) -> int:
        """A call starts at ``at``; returns its token for ``end``."""
        call = next(self._ids)
        self._open[call] = at
        return call

    def end(self, call: int, at: float) -> float:
        """The call ends at ``at``: the seconds of ``[start, at]`` not charged yet."""
        start = self._open.pop(call)
        at = max(at, start)
        covered = sum(max(0.0, min(b, at) - max(a, start)) for a, b in self._spans)
        self._spans = merged([*self._spans, (start, at)])
        # a span ending before every open call began can overlap no later charge
        oldest = min(self._open.values(), default=at)
        self._spans = [(a, b) for a, b in self._spans if b > oldest]
        return (at - start) - covered


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, overlapping or touching spans joined."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
