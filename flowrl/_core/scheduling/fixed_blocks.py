"""Deterministic mode's shards: fixed blocks of a stage's samples (sans-IO).

A sample's numbers may depend on which samples share its call, so in deterministic mode the
sample at position k of its run is in block k // batch_size of each stage. A block is cut
whole, in id order, once every member is ready (the run's last, short block once ``seal``
gives the run's size); blocks leave in the order they filled. Samples without a place (a
loop's body) are blocks of one. A block given back goes back whole once; samples given back
again are suspects, cut alone.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from .stage_queue import StageQueue


class FixedBlocks:
    """The blocks of every stage of one pool: runs' sizes once known, and the cut order."""

    def __init__(self) -> None:
        self._sealed: dict[int, int] = {}  # run -> its number of samples, once known
        self._order = itertools.count()  # cut blocks leave in the order they filled

    def ready(self, q: StageQueue, ids: list[int], places: Sequence[tuple[int, int]] | None) -> None:
        """Samples ``ids`` are ready at ``q``; ``places``: each one's (run, position in it)."""
        every: Sequence[tuple[int, int] | None] = [None] * len(ids) if places is None else places
        for i, place in zip(ids, every, strict=True):
            if place is None:
                self.cut(q, [i])
                continue
            key = (place[0], place[1] // q.batch_size)
            q.parked.setdefault(key, []).append(i)
            q.parked_n += 1
            self._unpark(q, key)

    def seal(self, run: int, count: int, stages: Iterable[StageQueue]) -> None:
        """Run ``run`` holds ``count`` samples (admission done): its last, short block may go."""
        self._sealed[run] = count
        for q in stages:
            for key in [k for k in q.parked if k[0] == run]:
                self._unpark(q, key)

    def _unpark(self, q: StageQueue, key: tuple[int, int]) -> None:
        """Cut block ``key`` if every member is ready (its size: a batch, or less at a run's end)."""
        count = self._sealed.get(key[0])
        size = q.batch_size if count is None else min(q.batch_size, count - key[1] * q.batch_size)
        if len(q.parked[key]) >= size:
            members = q.parked.pop(key)
            q.parked_n -= len(members)
            self.cut(q, sorted(members))

    def cut(self, q: StageQueue, ids: list[int]) -> None:
        """``ids`` leave together as one shard, in id order, after the blocks cut before them."""
        key = float(next(self._order))
        q.lengths[key] = len(ids)
        for i in ids:
            heapq.heappush(q.heap, (key, i))

    def give_back(self, q: StageQueue, back: list[int]) -> None:
        """Whole the first time (a replica's death is seldom its samples' fault); given back
        again, each is a suspect cut alone: the block rule breaks rather than one sample
        spending its block's retries."""
        again = [i for i in back if i in q.returned]
        whole = [i for i in back if i not in q.returned]
        if whole:
            q.returned.update(whole)
            self.cut(q, sorted(whole))
        for i in again:
            self.cut(q, [i])
        q.suspects.update(again)

    def forget(self) -> None:
        """Run numbers start again (a resume): no run's size known."""
        self._sealed.clear()
