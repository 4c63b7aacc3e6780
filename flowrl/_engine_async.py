"""Asynchronous training (layer 6): rollouts that run ahead of training under a staleness bound.

A rollout task produces episodes in order and hands them to the training loop through a
bounded stream (``max_staleness + 1`` episodes). Before episode ``e``'s rollout starts it waits
at the gate until enough episodes are trained and synced that every replica of every synced
model holds a version within the bound (``_staleness.rollout_needs``); a sync loads weights
between two shards of a replica, never in one. With ``on_stale="drop"`` or ``"regenerate"`` the
rollout starts one version earlier, and the samples that would train more than
``max_staleness`` versions behind are dropped, or generated again once the bound holds.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from ._batch import Sample
from ._engine_parts import Live
from ._errors import FlowDefinitionError, FlowError
from ._pipeline import plain_errors
from ._progress import Progress
from ._run_config import RunConfig
from ._sampler import EpisodeSampler
from ._staleness import lags, rollout_needs, staleness_field, too_stale, train_version


@dataclass
class Rollout:
    """One episode's rollout: its samples (dataset order) and when it ran (``perf_counter``)."""

    episode: int
    samples: list[Sample]
    started: float
    ended: float
    waited: float = 0.0  # how long training waited for it
    dropped: int = 0
    regenerated: int = 0


class Gate:
    """How many episodes are trained and synced; rollouts wait here for their turn."""

    def __init__(self, done: int) -> None:
        self.done = done
        self._moved: anyio.Event | None = None

    def set(self, done: int) -> None:
        self.done = done
        if self._moved is not None:
            self._moved.set()
            self._moved = None

    async def reach(self, needed: int) -> None:
        while self.done < needed:
            if self._moved is None:
                self._moved = anyio.Event()
            await self._moved.wait()


class Overlap:
    """The asynchronous half of ``Engine``."""

    config: RunConfig
    _episode: int
    _sampler: EpisodeSampler | None
    _versions: dict[str, int]
    _marks: dict[int, tuple[int, int]]
    _gate: Gate
    _progress: Progress

    def _episode_items(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def _train_episode(self, live: Live, rollout: Rollout) -> None:
        raise NotImplementedError

    async def _or_rebuild(self, live: Live, step: Callable[[Live, int], Awaitable[None]], target: int) -> None:
        raise NotImplementedError

    @property
    def overlapped(self) -> bool:
        """Whether rollouts run ahead of training (``max_staleness`` > 0, or a drop/regenerate policy)."""
        return self.config.max_staleness > 0 or self.config.on_stale != "wait"

    async def _roll_one(self, live: Live, episode: int) -> tuple[Rollout, list[dict[str, Any]]]:
        assert self._sampler is not None and live.rollout is not None
        # where this episode starts: a checkpoint taken while it runs resumes from here
        self._marks[episode] = (self._sampler.position, live.rollout.numbering()[0])
        items = self._episode_items()
        started = time.perf_counter()
        samples = await live.rollout.run(items)
        return Rollout(episode, samples, started, time.perf_counter()), items

    async def _learn_overlapped(self, live: Live, target: int) -> None:
        while self._episode < target:  # once more after each trainer rebuild
            await self._or_rebuild(live, self._overlap, target)

    async def _overlap(self, live: Live, target: int) -> None:
        self._gate = Gate(self._episode)
        send, recv = anyio.create_memory_object_stream[Rollout](self.config.max_staleness + 1)
        async with plain_errors(), anyio.create_task_group() as tg:
            tg.start_soon(self._roll_ahead, live, target, send)
            async with recv:
                waiting = time.perf_counter()
                async for rollout in recv:
                    rollout.waited = time.perf_counter() - waiting
                    await self._train_episode(live, rollout)
                    waiting = time.perf_counter()

    async def _roll_ahead(self, live: Live, target: int, send: Any) -> None:
        cfg = self.config
        slack = 0 if cfg.on_stale == "wait" else 1
        async with send:
            for e in range(self._episode, target):
                await self._gate.reach(rollout_needs(e, max_staleness=cfg.max_staleness, sync_every=cfg.sync_every,
                                                     slack=slack))
                rollout, items = await self._roll_one(live, e)
                if slack:
                    await self._refresh(live, rollout, items)
                await send.send(rollout)

    async def _refresh(self, live: Live, rollout: Rollout, items: list[dict[str, Any]]) -> None:
        """Drop, or generate again, the samples that would train more than the bound behind."""
        cfg, e = self.config, rollout.episode
        at_train = {m: train_version(e, cfg.sync_every) for m in self._versions}
        stale = too_stale(rollout.samples, at_train, cfg.max_staleness)
        if not stale:
            return
        if cfg.on_stale == "drop":
            rollout.samples = [s for i, s in enumerate(rollout.samples) if i not in set(stale)]
            rollout.dropped = len(stale)
            return
        await self._gate.reach(rollout_needs(e, max_staleness=cfg.max_staleness, sync_every=cfg.sync_every))
        assert live.rollout is not None
        # the samples generated again belong to episode e: its run number, then the next one's
        live.rollout.resume_at(live.rollout.numbering()[0], e)
        again = await live.rollout.run([items[i] for i in stale])
        live.rollout.resume_at(live.rollout.numbering()[0], e + 1)
        for i, sample in zip(stale, again):
            rollout.samples[i] = sample
        rollout.regenerated = len(stale)

    def _bounded(self, samples: list[Sample], train: list[Sample]) -> list[Sample]:
        """``train`` with each sample's staleness per synced model (``<model>_staleness``), after
        checking that the episode's own samples are within the bound."""
        bound = self.config.max_staleness
        over = too_stale(samples, self._versions, bound)
        if over:
            s = samples[over[0]]
            raise FlowError(
                f"internal: sample {s.id} of episode {self._episode} is {lags(s, self._versions)} versions behind, "
                f"over RunConfig.max_staleness={bound}"
            )
        out = []
        for s in train:
            fields = dict(s)
            for model, lag in lags(s, self._versions).items():
                if staleness_field(model) in fields:
                    raise FlowDefinitionError(f"sample {s.id} has a field {staleness_field(model)!r}: that name is reserved for "
                                    "the staleness the engine adds in asynchronous training")
                fields[staleness_field(model)] = lag
            out.append(Sample(s.id, fields))
        return out
