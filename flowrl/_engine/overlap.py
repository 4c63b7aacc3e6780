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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from .._core.batch import Sample
from .._core.errors import FlowDefinitionError, FlowError
from .._core.staleness import lags, rollout_needs, staleness_field, too_stale, train_version
from .._core.trace import ENGINE, Timeline
from .._pipeline.opening import plain_errors

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from anyio.abc import TaskGroup

    from .._core.run_config import RunConfig
    from .._core.sampler import EpisodeSampler
    from .._pipeline.progress import Progress
    from .checkpoints import Checkpoints
    from .parts import Live


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
    _ckpt: Checkpoints
    timeline: Timeline
    _background: TaskGroup | None = None  # while rollouts run ahead: where background syncs run
    _synced: anyio.Event | None = None  # set when the sync in the background has landed

    async def _snapshots(self, live: Live) -> list[tuple[str, Any]]:
        raise NotImplementedError

    async def _send(self, live: Live, name: str, version: int, weights: Any) -> None:
        raise NotImplementedError

    async def _sync(self, live: Live) -> None:
        raise NotImplementedError

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
        self._gate, self._synced = Gate(self._episode), None
        send, recv = anyio.create_memory_object_stream[Rollout](self.config.max_staleness + 1)
        try:
            async with plain_errors(), anyio.create_task_group() as tg:
                self._background = tg  # weight syncs sent while the next episode trains
                tg.start_soon(self._roll_ahead, live, target, send)
                async with recv:
                    waiting = time.perf_counter()
                    async for rollout in recv:
                        rollout.waited = time.perf_counter() - waiting
                        await self._train_episode(live, rollout)
                        waiting = time.perf_counter()
        finally:
            self._background = self._synced = None

    async def _roll_ahead(self, live: Live, target: int, send: Any) -> None:
        cfg = self.config
        slack = 0 if cfg.on_stale == "wait" else 1
        async with send:
            for e in range(self._episode, target):
                await self._gate.reach(
                    rollout_needs(e, max_staleness=cfg.max_staleness, sync_every=cfg.sync_every, slack=slack)
                )
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
            gone = set(stale)
            rollout.samples = [s for i, s in enumerate(rollout.samples) if i not in gone]
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

    def _train_versions(self, episode: int) -> dict[str, int]:
        """The versions synced models hold while ``episode`` trains. Asynchronous: the ones its
        trainer's weights stand for, whether or not a sync in the background has landed yet."""
        if not self.overlapped:
            return dict(self._versions)
        return {m: train_version(episode, self.config.sync_every) for m in self._versions}

    async def _after_training(self, live: Live, e: int, due: bool) -> None:
        """Sync after episode ``e`` trained, if ``due``, and open the gate for the rollouts that
        wait for it. Asynchronous, the weights are read now and sent in the background while
        the next episode trains (one sync at a time), unless an eval or checkpoint needs them."""
        await self._settle_sync()
        cfg = self.config
        background = (
            self._background is not None
            and not (cfg.eval_every and (e + 1) % cfg.eval_every == 0)
            and not self._ckpt.due(e + 1)
        )
        if not due or not background:
            if due:
                await self._sync(live)
            self._gate.set(e + 1)
            return
        snapshots = await self._snapshots(live)
        self._synced = anyio.Event()
        assert self._background is not None
        self._background.start_soon(self._push, live, snapshots, e, self._synced)

    async def _push(self, live: Live, snapshots: list[tuple[str, Any]], e: int, done: anyio.Event) -> None:
        started = time.time()
        for name, weights in snapshots:
            await self._send(live, name, train_version(e + 1, self.config.sync_every), weights)
        self._gate.set(e + 1)
        done.set()
        self.timeline.add(ENGINE, 2, "sync", started, time.time(), episode=e)  # in the background: a lane of its own

    async def _settle_sync(self) -> None:
        if self._synced is not None:
            await self._synced.wait()
            self._synced = None

    def _bounded(self, samples: list[Sample], train: list[Sample], versions: dict[str, int]) -> list[Sample]:
        """``train`` with each sample's staleness per synced model (``<model>_staleness``), after
        checking that the episode's own samples are within the bound."""
        bound = self.config.max_staleness
        over = too_stale(samples, versions, bound)
        if over:
            s = samples[over[0]]
            raise FlowError(
                f"internal: sample {s.id} of episode {self._episode} is {lags(s, versions)} versions behind, "
                f"over RunConfig.max_staleness={bound}"
            )
        out = []
        for s in train:
            fields = dict(s)
            for model, lag in lags(s, versions).items():
                if staleness_field(model) in fields:
                    raise FlowDefinitionError(
                        f"sample {s.id} has a field {staleness_field(model)!r}: that name is reserved for "
                        "the staleness the engine adds in asynchronous training"
                    )
                fields[staleness_field(model)] = lag
            out.append(Sample(s.id, fields))
        return out
