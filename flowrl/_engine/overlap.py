"""Asynchronous training: rollouts that run ahead of training under a staleness bound.

A rollout task produces episodes in order and hands them to the training loop through a
bounded stream (``staleness.max + 1`` episodes). Before episode ``e``'s rollout starts it waits
at the gate until enough episodes are trained and synced that every replica of every synced
model holds a version within the bound (``_core.training.staleness.rollout_needs``); a sync loads weights
between two shards of a replica, never in one. With ``on_stale="drop"`` or ``"regenerate"`` the
rollout starts one version earlier, and the samples that would train more than
``staleness.max`` versions behind are dropped, or generated again once the bound holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from .._core.errors import FlowDefinitionError, FlowError
from .._core.flow.batch import Sample
from .._core.observe.trace import ENGINE
from .._core.training.staleness import lags, rollout_needs, staleness_field, too_stale, train_version
from .._pipeline.opening import plain_errors
from .replay import run_record

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from anyio.abc import TaskGroup
    from anyio.streams.memory import MemoryObjectSendStream

    from .._core.observe.trace import Timeline
    from .._core.settings.run_config import RunConfig
    from .._pipeline.pipeline import AsyncPipeline
    from .checkpoint_files import CheckpointFormat
    from .learning import LearningState
    from .replay import Replay, ScheduleLog
    from .weight_sync import Snapshots, WeightSync


@dataclass
class Rollout:
    """One episode's rollout: its samples (dataset order), the row of its items each one came
    from, and when it ran (``perf_counter``)."""

    episode: int
    samples: list[Sample]
    rows: list[int]
    started: float
    ended: float
    waited: float = 0.0  # how long training waited for it
    dropped: int = 0
    regenerated: int = 0
    failed: int = 0  # items the pipeline dropped (ModelConfig.on_spent="drop")

    def keep(self, positions: set[int]) -> None:
        """Keep the samples at ``positions`` (and their rows), in order."""
        kept = [i for i in range(len(self.samples)) if i in positions]
        self.samples = [self.samples[i] for i in kept]
        self.rows = [self.rows[i] for i in kept]


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
    """When rollouts and weight syncs run relative to training. Synchronous (``StalenessConfig.overlaps``
    false): one episode's rollout, then its training, then the sync. Asynchronous: rollouts
    run ahead under the staleness bound, and a sync runs in the background while the next
    episode trains. Owns the gate and the background sync in flight."""

    def __init__(
        self,
        config: RunConfig,
        learning: LearningState,
        rollout: AsyncPipeline,
        weights: WeightSync,
        checkpoints: CheckpointFormat,
        timeline: Timeline,
        record: ScheduleLog | None = None,
        replay: Replay | None = None,
    ) -> None:
        self.config = config
        self.record, self.replay = record, replay
        self.enabled = config.staleness.overlaps
        self.learning = learning
        self.rollout = rollout
        self.weights = weights
        self.checkpoints = checkpoints
        self.timeline = timeline
        self._gate = Gate(0)  # episodes trained and synced: rollouts ahead of training wait on it
        self._background: TaskGroup | None = None  # while rollouts run ahead: where background syncs run
        self._synced: anyio.Event | None = None  # set when the sync in the background has landed

    async def roll(self, episode: int) -> tuple[Rollout, list[dict[str, Any]]]:
        """``episode``'s rollout, and the items drawn for it."""
        pipe = self.rollout
        first = pipe.numbering()[0]
        items = self.learning.draw(episode, first)
        costs = self.learning.estimates(episode, items)
        started = time.perf_counter()
        samples = await self._run(episode, 0, items, costs)
        ended = time.perf_counter()
        rows = [s.id - first for s in samples]  # ids follow the items; a dropped one leaves a gap
        self.learning.remember(episode, samples, rows)
        if self.record is not None and self.config.staleness.on_stale == "wait":  # else once _refresh is done
            self.record.done(episode)
        return Rollout(episode, samples, rows, started, ended, failed=len(items) - len(samples)), items

    async def _run(
        self, episode: int, index: int, items: list[dict[str, Any]], costs: list[float] | None
    ) -> list[Sample]:
        """Run ``index`` of ``episode``'s rollout (the first, or the samples generated again),
        as a replayed schedule says, and recorded where one is recorded."""
        first = self.rollout.numbering()[0]
        if self.replay is not None:
            samples = await self.replay.run(self.rollout, episode, index, items, costs)
        else:
            samples = await self.rollout.run(items, costs=costs)
        if self.record is not None:
            self.record.ran(episode, index, run_record(first, len(items), samples, sorted(self.weights.versions)))
        return samples

    async def run(self, target: int, train: Callable[[Rollout], Awaitable[None]]) -> None:
        """Roll out episodes up to ``target`` ahead of training, and ``train`` each in order."""
        self._gate, self._synced = Gate(self.learning.episode), None
        if self.replay is not None:
            self.replay.window(self.learning.episode, target)
        send, recv = anyio.create_memory_object_stream[Rollout](self.config.staleness.max + 1)
        try:
            async with plain_errors(), anyio.create_task_group() as tg:
                self._background = tg  # weight syncs sent while the next episode trains
                tg.start_soon(self._roll_ahead, target, send)
                async with recv:
                    waiting = time.perf_counter()
                    async for rollout in recv:
                        rollout.waited = time.perf_counter() - waiting
                        await train(rollout)
                        waiting = time.perf_counter()
        finally:
            self._background = self._synced = None

    async def _roll_ahead(self, target: int, send: MemoryObjectSendStream[Rollout]) -> None:
        cfg = self.config
        slack = 0 if cfg.staleness.on_stale == "wait" else 1
        async with send:
            for e in range(self.learning.episode, target):
                await self._gate.reach(
                    rollout_needs(e, max_staleness=cfg.staleness.max, sync_every=cfg.sync_every, slack=slack)
                )
                rollout, items = await self.roll(e)
                if slack:
                    await self._refresh(rollout, items)
                    if self.record is not None:
                        self.record.done(e)
                await send.send(rollout)

    async def _refresh(self, rollout: Rollout, items: list[dict[str, Any]]) -> None:
        """Drop, or generate again, the samples that would train more than the bound behind."""
        cfg, e = self.config, rollout.episode
        at_train = {m: train_version(e, cfg.sync_every) for m in self.weights.versions}
        stale = too_stale(rollout.samples, at_train, cfg.staleness.max, cfg.staleness.segment)
        if not stale:
            return
        if cfg.staleness.on_stale == "drop":
            rollout.keep(set(range(len(rollout.samples))) - set(stale))
            rollout.dropped = len(stale)
            return
        await self._gate.reach(rollout_needs(e, max_staleness=cfg.staleness.max, sync_every=cfg.sync_every))
        pipe = self.rollout
        # the samples generated again belong to episode e: its run number, then the next one's
        first = pipe.numbering()[0]
        pipe.resume_at(first, e)
        rows = [rollout.rows[i] for i in stale]
        redo = [items[r] for r in rows]
        again = await self._run(e, 1, redo, self.learning.estimates(e, redo, rows))
        pipe.resume_at(pipe.numbering()[0], e + 1)
        for sample in again:
            rollout.samples[stale[sample.id - first]] = sample
        came = {stale[s.id - first] for s in again}
        rollout.keep(set(range(len(rollout.samples))) - (set(stale) - came))  # those dropped again are gone
        rollout.failed += len(stale) - len(again)
        rollout.regenerated = len(again)

    def train_versions(self, episode: int) -> dict[str, int]:
        """The versions synced models hold while ``episode`` trains. Asynchronous: the ones its
        trainer's weights stand for, whether or not a sync in the background has landed yet."""
        if not self.enabled:
            return self.weights.versions
        return {m: train_version(episode, self.config.sync_every) for m in self.weights.versions}

    async def after_training(self, e: int, due: bool) -> None:
        """Sync after episode ``e`` trained, if ``due``, and open the gate for the rollouts that
        wait for it. Asynchronous, the weights are read now and sent in the background while
        the next episode trains (one sync at a time), unless an eval or checkpoint needs them."""
        await self._settle_sync()
        cfg = self.config
        background = (
            self._background is not None
            and not (cfg.eval_every and (e + 1) % cfg.eval_every == 0)
            and not self.checkpoints.due(e + 1)
        )
        if not due or not background:
            if due:
                await self.weights.sync()
            self._gate.set(e + 1)
            return
        snapshots = await self.weights.snapshots()
        self._synced = anyio.Event()
        assert self._background is not None
        self._background.start_soon(self._push, snapshots, e, self._synced)

    async def _push(self, snapshots: Snapshots, e: int, done: anyio.Event) -> None:
        started = time.time()
        version = train_version(e + 1, self.config.sync_every)
        await self.weights.send_all([(name, version, weights) for name, weights in snapshots])
        self._gate.set(e + 1)
        done.set()
        self.timeline.add(ENGINE, 2, "sync", started, time.time(), episode=e)  # in the background: a lane of its own

    async def _settle_sync(self) -> None:
        if self._synced is not None:
            await self._synced.wait()
            self._synced = None

    def bounded(
        self, episode: int, samples: list[Sample], train: list[Sample], versions: dict[str, int]
    ) -> list[Sample]:
        """``train`` with each sample's staleness per synced model (``<model>_staleness``), after
        checking that the episode's own samples are within the bound."""
        bound, segment = self.config.staleness.max, self.config.staleness.segment
        over = too_stale(samples, versions, bound, segment)
        if over:
            s = samples[over[0]]
            raise FlowError(
                f"internal: sample {s.id} of episode {episode} is {lags(s, versions, segment)} versions behind, "
                f"over RunConfig.staleness.max={bound}"
            )
        return [_with_staleness(s, versions, segment) for s in train]


def _with_staleness(sample: Sample, versions: dict[str, int], segment: str) -> Sample:
    fields = dict(sample)
    for model, lag in lags(sample, versions, segment).items():
        if staleness_field(model) in fields:
            raise FlowDefinitionError(
                f"sample {sample.id} has a field {staleness_field(model)!r}: that name is reserved for "
                "the staleness the engine adds in asynchronous training"
            )
        fields[staleness_field(model)] = lag
    return Sample(sample.id, fields, sample.kinds)
