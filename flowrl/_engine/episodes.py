"""The episode loop: per episode, its rollout, the relay buffer, training, the weight
sync, evaluation, then the episode's stats, metrics and checkpoint."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio

from .._core.errors import CheckpointError
from .._core.flow.loops import turn_counts
from .._core.observe.trace import ENGINE
from .._core.training.staleness import histogram, segment_histogram
from .engine_stats import EpisodeStats, mean_metrics
from .engine_view import Progress
from .run_folder import metric_values

if TYPE_CHECKING:
    from .._core.flow.batch import Sample
    from .._core.observe.trace import Timeline
    from .._core.settings.run_config import RunConfig
    from .checkpoints import CheckpointManager
    from .deployment import Deployment
    from .elastic import Elasticity
    from .learning import LearningState
    from .overlap import Overlap, Rollout
    from .run_folder import RunDir
    from .tracking import Tracking
    from .training import TrainSteps


Lags = tuple[dict[str, dict[int, int]], dict[str, dict[int, int]]]  # per sample, per segment


class EpisodeLoop:
    """Runs episodes until ``learn(target)``'s target, rebuilding a trainer whose rank died; owns
    the progress view of the ``learn()`` under way."""

    def __init__(
        self,
        config: RunConfig,
        learning: LearningState,
        deployment: Deployment,
        trainers: TrainSteps,
        overlap: Overlap,
        checkpoints: CheckpointManager,
        elasticity: Elasticity,
        run_dir: RunDir | None,
        timeline: Timeline,
        *,
        syncing: bool,
        tracking: Tracking,
    ) -> None:
        self.config = config
        self.learning = learning
        self.deployment = deployment
        self.trainers = trainers
        self.overlap = overlap
        self.checkpoints = checkpoints
        self.elasticity = elasticity
        self.run_dir = run_dir
        self.timeline = timeline
        self.syncing = syncing  # any trainer sends its weights to a model: a sync phase to show
        self.tracking = tracking
        self._progress = Progress("off", 0)

    async def learn(self, target: int) -> None:
        """Episodes up to ``target`` episodes done (a resumed run starts after its checkpoint's)."""
        learning, cfg = self.learning, self.config
        await self.checkpoints.begin(target, Progress(cfg.progress, target).say)
        if learning.episode > target:  # a checkpoint past this run's end would skip training silently
            raise CheckpointError(
                f"checkpoint {self.checkpoints.folder} is after episode {learning.episode}, past this run's end: "
                f"learn() runs up to episode {target} (RunConfig.num_episode={cfg.num_episode} per learn() call); "
                "raise num_episode or resume from an earlier checkpoint (RunConfig.checkpoint.resume)"
            )
        self._progress = Progress(cfg.progress, target, learning.episode, self._trainer_rows)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._progress.watch, self.deployment.rollout, cfg.sample_per_episode)
            if self.run_dir is not None:
                await tg.start(self.elasticity.watch_requests, self.run_dir.path)  # live.json before episode 0
            if self.overlap.enabled:
                while learning.episode < target:  # once more after each trainer rebuild
                    await self.checkpoints.rebuilding(lambda: self.overlap.run(target, self._train_episode))
            while learning.episode < target:
                await self.checkpoints.rebuilding(self._one_episode)
            tg.cancel_scope.cancel()

    def _trainer_rows(self) -> dict[str, tuple[int, int, int]]:
        return self.deployment.trainer_rows({n: t.samples for n, t in self.learning.counters.stats().items()})

    async def _one_episode(self) -> None:
        self._progress.phase = "rollout"
        rollout, _ = await self.overlap.roll(self.learning.episode)
        rollout.waited = rollout.ended - rollout.started
        await self._train_episode(rollout)

    async def _train_episode(self, rollout: Rollout) -> None:
        e, learning = self.learning.episode, self.learning
        offset = time.time() - time.perf_counter()  # perf_counter -> wall clock, for the timeline
        t1 = time.perf_counter()
        train, lags = self._samples_to_train(e, rollout)
        self._progress.phase = "train"
        results = await self.trainers.train(train, e)
        t2 = time.perf_counter()
        synced = (e + 1) % self.config.sync_every == 0
        if synced and self.syncing or self.overlap.enabled:
            self._progress.phase = "sync" if synced and self.syncing else "staleness gate"
        await self.overlap.after_training(e, synced)  # the sync, or its start; then the gate
        t3 = time.perf_counter()
        if self.learning.eval_due(e):
            self._progress.phase = "eval"
        evaluated = await self._evaluate(e)
        t4 = time.perf_counter()
        phases = (
            ("rollout", rollout.started, rollout.ended, True),
            ("train", t1, t2, bool(train)),
            ("sync", t2, t3, synced and self.syncing),
            ("eval", t3, t4, evaluated),
        )
        self._trace(e, offset, phases)
        stats = EpisodeStats(
            episode=e,
            samples=len(rollout.samples),
            rollout_s=rollout.ended - rollout.started,
            train_s=t2 - t1,
            sync_s=t3 - t2,
            eval_s=t4 - t3,
            wait_s=rollout.waited,
            dropped=rollout.dropped,
            regenerated=rollout.regenerated,
            failed=rollout.failed,
            metrics={k: mean_metrics(v) for k, v in results.items()},
            staleness=lags[0],
            segment_staleness=lags[1],
            turns=turn_counts(rollout.samples, self.deployment.rollout.graph.loops.values()),
            weight_versions=self.overlap.train_versions(e + 1),
        )
        learning.episode_done(stats, results)
        await self._episode_end()

    def _samples_to_train(self, e: int, rollout: Rollout) -> tuple[list[Sample], Lags]:
        """What episode ``e`` trains on (through the relay buffer), and their staleness (per
        sample, and per segment of a partial rollout)."""
        train = self.learning.relay_samples(e, rollout.samples)
        versions = self.overlap.train_versions(e)
        lags = histogram(train, versions, self.config.staleness.segment), segment_histogram(train, versions)
        if self.overlap.enabled:
            train = self.overlap.bounded(e, rollout.samples, train, versions)
        return train, lags

    async def _evaluate(self, e: int) -> bool:
        """Run the evaluation flow if one is due after episode ``e``; whether it ran."""
        evaluation, dataset = self.deployment.evaluation, self.learning.eval_dataset
        if not self.learning.eval_due(e) or evaluation is None or dataset is None:
            return False
        self.learning.eval_results.append(await evaluation.run(dataset))
        return True

    def _trace(self, e: int, offset: float, phases: tuple[tuple[str, float, float, bool], ...]) -> None:
        """The phases that ran on the timeline, by the wall clock (``offset`` from ``perf_counter``)."""
        for phase, start, end, ran in phases:
            if ran:  # overlapped rollouts get a lane of their own
                lane = int(phase == "rollout" and self.overlap.enabled)
                self.timeline.add(ENGINE, lane, phase, offset + start, offset + end, episode=e)

    async def _episode_end(self) -> None:
        learning = self.learning
        stats = learning.stats(self.deployment.stats(), self.deployment.replaced())
        if self.run_dir is not None:
            self.run_dir.episode(stats)
        self.deployment.backend.export_metrics(metric_values(stats))
        learning.episode += 1
        if self.checkpoints.due(learning.episode):
            await self.checkpoints.save()
        await self.tracking.episode(stats)  # after the checkpoint: a callback that fails leaves it to resume from
        self._progress.episode_done(learning.episodes[-1], self.deployment.rollout)
