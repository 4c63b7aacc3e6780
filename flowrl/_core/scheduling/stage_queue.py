"""What a pool's scheduler keeps per stage, and the shards it hands out (sans-IO)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .call_cost import CallCost

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass
class StageQueue:
    name: str
    batch_size: int  # the most samples of one step (a micro-batch)
    most: int = 0  # the most samples of one call (several micro-batches; 0: ``batch_size``)
    prefetch: int = 1  # shards a replica holds at once
    expected: int = 0
    wave: int = 0  # the samples expected since the stage last had none left (this run's, say)
    dispatched: int = 0
    finished: int = 0
    holders: int = 0  # replicas running samples of this stage
    peak: int = 0  # the most samples ever left waiting after a poll (no replica free to take them)
    admitted: int = 0  # samples inside the pipeline that will reach this stage (``admit``)
    floor: int = 1  # the smallest shard worth a call, from ``measure``
    prior: tuple[float, float] | None = None  # (fixed, per-sample) seconds of a call, from config
    heap: list[tuple[float, int]] = field(default_factory=list)  # (-cost, sample id)
    suspects: set[int] = field(default_factory=set)  # given back by a failed call: each cut alone
    # deterministic: (run, block) -> its members ready; a cut block's heap key -> its size; given back once
    parked: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    parked_n: int = 0
    lengths: dict[float, int] = field(default_factory=dict)
    returned: set[int] = field(default_factory=set)
    fit: CallCost = field(init=False)  # the call's cost, refitted from measured calls

    def __post_init__(self) -> None:
        self.most = self.most or self.batch_size
        self.fit = CallCost(self.batch_size, prior=self.prior, most=self.most, prefetch=self.prefetch)

    def push(self, ids: list[int], costs: Sequence[float] | None) -> None:
        """Samples ``ids`` are pending, costliest first; ``costs`` has one per sample (strict:
        a short list fails instead of leaving samples out)."""
        pairs = ((i, 0.0) for i in ids) if costs is None else zip(ids, costs, strict=True)
        for i, cost in pairs:
            heapq.heappush(self.heap, (-cost, i))

    @property
    def remaining(self) -> int:
        """Samples not finished yet: pending, still upstream, or running."""
        return self.expected - self.finished

    @property
    def coming(self) -> int:
        """Samples admitted into the pipeline but not yet ready for this stage: they are
        upstream, so they arrive (a stage that waits for them cannot wait for admission)."""
        return max(0, self.admitted - self.dispatched - len(self.heap))


@dataclass(frozen=True)
class Assignment:
    replica: int
    stage: str
    ids: list[int]
