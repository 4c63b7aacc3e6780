"""Checkpoints of a running engine: write one, resume from one, and rebuild a trainer
group whose rank died from the last one."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .._core.errors import StageError
from .._pipeline.opening import plain_errors
from .engine_stats import Rebuild
from .survivors import cannot_rebuild, rank_death

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from .._core.errors import ReplicaDiedError
    from .._core.flow.model import Model
    from .._core.settings.run_config import RunConfig
    from .checkpoint_files import CheckpointFormat
    from .checkpoint_state import EngineState
    from .deployment import Deployment
    from .learning import LearningState
    from .survivors import TrainerRestarts
    from .weight_sync import WeightSync

log = logging.getLogger("flowrl")


class CheckpointManager:
    """Owns the last checkpoint written or resumed from and the count of trainer rebuilds;
    writes ``learning``'s state, the trainers' and the synced weights into ``files``."""

    def __init__(
        self,
        config: RunConfig,
        files: CheckpointFormat,
        learning: LearningState,
        trainers: list[Model],
        deployment: Deployment,
        weights: WeightSync,
        restarts: TrainerRestarts,
    ) -> None:
        self.config = config
        self.files = files
        self.learning = learning
        self.trainers = trainers
        self.deployment = deployment
        self.weights = weights
        self.restarts = restarts
        self._begun = False  # resumed from a checkpoint, or wrote the first one
        self._folder: Path | None = None

    def due(self, episodes_done: int) -> bool:
        return self.files.due(episodes_done)

    @property
    def folder(self) -> Path | None:
        """The last checkpoint written or resumed from."""
        return self._folder

    async def begin(self, total: int, say: Callable[[str], None]) -> None:
        """Once per engine: resume from a checkpoint (``say`` tells the user which, and where in
        a run of ``total`` episodes), or write the first one (after 0 or the resumed episodes)
        so that a trainer rank dying early has one to be rebuilt from."""
        if self._begun:
            return
        self._begun = True
        source = self.files.source()
        if source is not None:
            await self._restore(source)
            say(resume_line(source, self.learning.episode, total, self.weights.versions))
        elif self.files.writes:
            await self.save()

    async def save(self) -> None:
        state = self._state()
        synced = {n: self.weights.sent(n) for n in state.synced}
        self._reached(await self.files.save(state, self.learning.relay.carried(), self.deployment, synced))

    async def rebuilding(self, step: Callable[[], Awaitable[None]]) -> None:
        """``step``; a trainer rank that died in it rebuilds the trainer from the last checkpoint."""
        try:
            async with plain_errors():
                await step()
        except StageError as err:
            trainer = err.stage.partition(".")[0]
            died = await rank_death(self.deployment, trainer, err) if trainer in self.deployment.trainers else None
            if died is None:
                raise
            await self._rebuild(trainer, died)

    def _state(self) -> EngineState:
        deployment, versions = self.deployment, self.weights.versions
        evaluation = deployment.evaluation
        between_syncs = self.learning.episode % self.config.sync_every != 0  # the trainer moved on since
        return self.learning.snapshot(
            next_sample_id=deployment.rollout.numbering()[0],
            eval_numbering=evaluation.numbering() if evaluation is not None else (0, 0),
            trainer_ranks={name: len(ranks) for name, ranks in deployment.trainers.items()},
            weight_versions=versions,
            synced=sorted(n for n, v in versions.items() if v and between_syncs),
        )

    def _reached(self, folder: Path) -> None:
        self._folder = folder
        self.weights.keep_first_weights()

    async def _restore(self, folder: Path) -> None:
        learning, deployment = self.learning, self.deployment
        assert learning.dataset is not None, "restore before set_dataset()"
        state, relay = self.files.load(
            folder,
            dataset_size=len(learning.dataset),
            trainers=list(deployment.trainers),
            targets=[target.name for _, target in self.weights.pairs],
        )
        await self.files.restore_trainers(folder, deployment)
        for trainer, target in self.weights.pairs:
            want = state.weight_versions.get(target.name, 0)
            saved = self._saved_weights(folder, target.name) if target.name in state.synced else None
            await self.weights.restore(trainer.name, target.name, want, saved)
        learning.restore(state, relay)
        await deployment.rollout.settle()  # a rollout that ran ahead of training is done again
        deployment.rollout.resume_at(state.next_sample_id, state.episode)
        if deployment.evaluation is not None:
            deployment.evaluation.resume_at(state.eval_next_id, state.eval_runs)
        self._reached(folder)

    def _saved_weights(self, folder: Path, target: str) -> Callable[[], Any]:
        return lambda: self.files.synced_weights(folder, target)

    def _may_rebuild(self, trainer: str, err: ReplicaDiedError) -> Path:
        """The checkpoint to rebuild ``trainer`` from, one more restart counted; or ``err``, saying why not."""
        folder = self._folder
        if folder is None:
            why = (
                f"no checkpoint to rebuild trainer {trainer!r} from (set RunConfig.checkpoint.dir and checkpoint.every)"
            )
            raise cannot_rebuild(err, why) from err
        self.restarts.take(trainer, err)
        return folder

    async def _rebuild(self, trainer: str, err: ReplicaDiedError) -> None:
        """A rank of ``trainer`` died: start its group again and go back to the last checkpoint.
        A rank that dies during the rebuild (its setup, the restore) starts it again, within
        ``max_trainer_restarts`` in all."""
        noticed, done = time.monotonic(), self.learning.episode
        while True:
            folder = self._may_rebuild(trainer, err)
            log.warning("trainer %r: %s; rebuilding its ranks from checkpoint %s", trainer, err, folder)
            try:
                await self.deployment.restart_trainer(next(m for m in self.trainers if m.name == trainer))
                self.weights.forget(trainer)  # what it sent lived in its process: send again from the checkpoint
                await self._restore(folder)
                break
            except StageError as again:
                died = await rank_death(self.deployment, trainer, again)
                if died is None:
                    raise
                err = died
        learning = self.learning
        learning.undo(range(learning.episode, done))  # episodes to run again
        seconds = time.monotonic() - noticed
        rebuilt = Rebuild(
            trainer=trainer, rank=err.replica, episode=learning.episode, redone=done - learning.episode, seconds=seconds
        )
        learning.rebuilds.append(rebuilt)


def resume_line(folder: Path, done: int, total: int, versions: dict[str, int]) -> str:
    """``resuming from runs/x/episode-000020: episode 21 of 30, weights version 20``."""
    line = f"resuming from {folder}: episode {min(done + 1, total)} of {total}"
    if len(set(versions.values())) == 1:
        line += f", weights version {next(iter(versions.values()))}"
    elif versions:
        line += ", weights versions " + ", ".join(f"{name} {v}" for name, v in versions.items())
    return line
