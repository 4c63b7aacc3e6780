"""A trainer rank that died in a train step: which rank, the count of rebuilds, and a group
rebuilt from a surviving rank's state, so that only the broken step runs again.

A survivor's state is the one the broken step began with only where flowrl knows what the step
changed: flowrl sums the gradients (``auto_reduce_grads``) before each optimizer step, nothing
is sharded, and the survivor's step broke before any gradient sum completed. Each rank's random
generators as of its last completed step come back with its results, so the new ranks start the
step again from the same state, bit for bit. Otherwise the last checkpoint (``checkpoints``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import anyio

from .._core.errors import ReplicaDiedError, StageError
from .._pipeline.opening import plain_errors
from .engine_stats import Rebuild

if TYPE_CHECKING:
    from .._backends.specs import ReplicaHandle
    from .._core.flow.model import Model
    from .._core.settings.run_config import RunConfig
    from .deployment import Deployment
    from .learning import LearningState
    from .weight_sync import WeightSync

log = logging.getLogger("flowrl")


class TrainerRestarts:
    """Rebuilds of the trainers, from a survivor or a checkpoint alike, bounded by
    ``RunConfig.checkpoint.max_trainer_restarts`` over the run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def take(self, trainer: str, err: ReplicaDiedError) -> None:
        """Count one more rebuild of ``trainer``; or raise ``err``, saying why not."""
        if self.count >= self.limit:
            why = f"trainer {trainer!r} was rebuilt {self.count} times already "
            why += f"(RunConfig.checkpoint.max_trainer_restarts={self.limit})"
            raise cannot_rebuild(err, why) from err
        self.count += 1

    @property
    def spent(self) -> bool:
        return self.count >= self.limit


async def rank_death(deployment: Deployment, trainer: str, err: StageError) -> ReplicaDiedError | None:
    """``err`` as the death of one of ``trainer``'s ranks; None if none died."""
    if isinstance(err, ReplicaDiedError):
        return err
    # a peer of a rank that died may report its broken collective first
    backend = deployment.backend
    dead = [r.replica_id for r in deployment.trainers[trainer] if not await backend.alive(r)]
    if not dead:
        return None
    return ReplicaDiedError(
        f"the process of rank {dead[0]} died; a peer reported {err.message}", err.stage, dead[0], err.sample_ids
    )


def cannot_rebuild(err: ReplicaDiedError, why: str) -> ReplicaDiedError:
    return ReplicaDiedError(f"{err.message}; {why}", err.stage, err.replica, err.sample_ids)


class SurvivorRebuild:
    """Keeps each rank's random generators as of its last completed step; rebuilds a group
    whose rank died from a survivor's state where that state is known."""

    def __init__(
        self,
        config: RunConfig,
        models: list[Model],
        deployment: Deployment,
        weights: WeightSync,
        learning: LearningState,
    ) -> None:
        self.config = config
        self.models = {m.name: m for m in models}
        self.deployment = deployment
        self.weights = weights
        self.learning = learning
        self.restarts = TrainerRestarts(config.checkpoint.max_trainer_restarts)  # shared with the checkpoint's
        # per trainer: its ranks (a group started again is a new list) and each rank's generators
        self._rngs: dict[str, tuple[list[ReplicaHandle], list[bytes | None]]] = {}

    def _known(self, trainer: str) -> list[bytes | None] | None:
        """Each rank's generators as of its last step, if known for the ranks running now."""
        ranks, rngs = self._rngs.get(trainer, (None, None))
        return rngs if ranks is self.deployment.trainers[trainer] else None

    async def prime(self, trainer: str) -> None:
        """Before a group's first step: each rank's generators as set up (or restored), read
        without its state, so that a death in that step too has a survivor's rebuild."""
        ranks = self.deployment.trainers[trainer]
        if self._known(trainer) is not None or len(ranks) < 2 or not self.config.checkpoint.rebuild_from_survivor:
            return
        rngs: list[bytes | None] = [None] * len(ranks)

        async def one(r: int) -> None:
            _, rngs[r] = await self.deployment.backend.save_state(ranks[r], alone=True)  # no step yet: no state

        async with plain_errors(), anyio.create_task_group() as tg:
            for r in range(len(ranks)):
                tg.start_soon(one, r)
        self._rngs[trainer] = ranks, rngs

    def record(self, trainer: str, results: list[dict[str, Any]]) -> None:
        """A step every rank completed: keep each rank's generators (taken out of its results)."""
        self._rngs[trainer] = self.deployment.trainers[trainer], [res.pop("_rng", None) for res in results]

    async def rebuild(self, trainer: str, err: StageError) -> bool:
        """A step of ``trainer`` broke with ``err``: if a rank died and a survivor's state is the
        one the step began with, start the group again from it (True: run the step again)."""
        rngs = self._known(trainer)
        if rngs is None or len(rngs) < 2 or not self.config.checkpoint.rebuild_from_survivor:
            return False  # one rank, or its generators unknown: the checkpoint
        if self.restarts.spent:
            return False  # the checkpoint's rebuild says that none is left
        died = await rank_death(self.deployment, trainer, err)
        if died is None:
            return False
        noticed = time.monotonic()
        state = await self._survivor_state(trainer, died.replica)
        if state is None:
            return False
        log.warning("trainer %r: %s; rebuilding its ranks from a surviving rank's state", trainer, died)
        while True:
            self.restarts.take(trainer, died)
            try:
                await self._restart(trainer, state, rngs)
                break
            except StageError as again:
                died_again = await rank_death(self.deployment, trainer, again)
                if died_again is None:
                    raise
                if self.restarts.spent:
                    raise died_again from again  # the checkpoint's rebuild says that none is left
                died = died_again
        await self.weights.rehome(trainer)
        seconds = time.monotonic() - noticed
        rebuilt = Rebuild(
            trainer=trainer,
            rank=died.replica,
            episode=self.learning.episode,
            redone=0,
            seconds=seconds,
            source="survivor",
        )
        self.learning.rebuilds.append(rebuilt)
        return True

    async def _survivor_state(self, trainer: str, dead: int) -> bytes | None:
        """The model state of the first live rank whose broken step changed nothing; None if
        none answers within the collective timeout (one may still wait in a collective)."""
        backend = self.deployment.backend
        for rank in self.deployment.trainers[trainer]:
            if rank.replica_id == dead or not await backend.alive(rank):
                continue
            with anyio.move_on_after(self.config.collective_timeout_s):
                try:
                    state, _ = await backend.save_state(rank, alone=True)
                except StageError:
                    continue
                if state is not None:
                    return state
        return None

    async def _restart(self, trainer: str, state: bytes, rngs: list[bytes | None]) -> None:
        """New ranks, each with the survivor's state and its own generators."""
        await self.deployment.restart_trainer(self.models[trainer])
        backend = self.deployment.backend
        async with plain_errors(), anyio.create_task_group() as tg:
            for r, rank in enumerate(self.deployment.trainers[trainer]):
                tg.start_soon(backend.load_state, rank, state, rngs[r])
