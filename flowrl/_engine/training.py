"""Training: every trainer's steps over an episode's samples, each global batch split
over the trainer group's data-parallel ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from .._core.errors import RankDivergenceError, StageError
from .._core.flow.batch import Batch, Sample
from .._core.training.sampler import TrainStep, plan_steps
from .._pipeline.opening import plain_errors

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._backends.specs import ReplicaHandle
    from .._core.flow.model import Model
    from .._core.observe.trace import Timeline
    from .._core.settings.run_config import RunConfig
    from .deployment import Deployment
    from .engine_stats import TrainCounters
    from .learning import TrainResults
    from .survivors import SurvivorRebuild

RankResult = dict[str, Any]


class TrainSteps:
    """Runs the trainer groups' steps; counts each rank's samples, steps and busy time in
    ``counters`` and puts each step on ``timeline`` (a lane per rank)."""

    def __init__(
        self,
        config: RunConfig,
        models: list[Model],
        deployment: Deployment,
        counters: TrainCounters,
        timeline: Timeline,
        survivors: SurvivorRebuild,
    ) -> None:
        self.config = config
        self.models = models
        self.deployment = deployment
        self.counters = counters
        self.timeline = timeline
        self.survivors = survivors

    async def train(self, samples: Sequence[Sample], episode: int) -> TrainResults:
        """Every trainer, at once, on ``samples``: per trainer, per step, each rank's result."""
        results: TrainResults = {m.name: [] for m in self.models}
        if samples:
            batch = Batch.from_samples([s.id for s in samples], samples)  # Samples: each column as produced
            async with anyio.create_task_group() as tg:
                for m in self.models:
                    tg.start_soon(self._train, m.name, batch, episode, results[m.name])
        return results

    async def _train(self, trainer: str, batch: Batch, episode: int, out: list[list[RankResult]]) -> None:
        cfg = self.config
        steps = plan_steps(
            len(batch),
            global_batch=cfg.global_batch,
            micro_batch=cfg.micro_batch,
            dp=len(self.deployment.trainers[trainer]),
            group=cfg.num_samples_per_prompt,
            keys=batch["prompt_index"] if "prompt_index" in batch else None,
        )
        # each rank's shard goes to the object store once per episode, whatever the epochs
        rows = [[[r for mb in rank for r in mb] for rank in s.ranks] for s in steps]
        shards = [[self.deployment.backend.put(batch.select(rank)) for rank in step_rows] for step_rows in rows]
        for _ in range(cfg.num_training_epoch):
            for step, refs, step_rows in zip(steps, shards, rows, strict=True):
                ids = [batch.ids[r].tolist() for r in step_rows]
                results = await self._step(trainer, step, refs, ids, episode)
                check_same_weights(trainer, results, episode)
                self._count(trainer, results, ids, episode)
                out.append(results)

    async def _step(
        self, trainer: str, step: TrainStep, refs: list[Any], ids: list[list[int]], episode: int
    ) -> list[RankResult]:
        """One train step of every rank; again on new ranks after a rank died, where the group
        was rebuilt from a survivor (else the error: the last checkpoint's rebuild)."""
        while True:
            try:
                async with plain_errors():
                    await self.survivors.prime(trainer)
                    results = await self._ranks_step(self.deployment.trainers[trainer], step, refs, ids, episode)
            except StageError as err:
                if await self.survivors.rebuild(trainer, err):
                    continue
                raise
            self.survivors.record(trainer, results)
            return results

    async def _ranks_step(
        self, ranks: list[ReplicaHandle], step: TrainStep, refs: list[Any], ids: list[list[int]], episode: int
    ) -> list[RankResult]:
        """One train step: every rank on its shard, at once."""
        results: list[RankResult] = [{} for _ in refs]
        backend, micro_batch = self.deployment.backend, self.config.micro_batch

        async def one(i: int) -> None:
            results[i] = await backend.train(ranks[i], refs[i], ids[i], step.size, micro_batch, episode)

        async with anyio.create_task_group() as tg:
            for i in range(len(refs)):
                tg.start_soon(one, i)
        return results

    def _count(self, trainer: str, results: list[RankResult], ids: list[list[int]], episode: int) -> None:
        for rank, res in enumerate(results):
            busy, started = res.pop("_busy_s"), res.pop("_started")
            self.counters.add(trainer, rank, res["_samples"], busy)
            self.timeline.add(
                trainer,
                rank,
                "train_step",
                started,
                started + busy,
                episode=episode,
                samples=res["_samples"],
                ids=ids[rank],
            )


def check_same_weights(trainer: str, results: list[RankResult], episode: int) -> None:
    """After a group's first train step each rank reports a fingerprint of its trainable
    weights, before and after the step (``_backends.grad_sync.checksum``); they must agree
    exactly: ranks that summed the same gradients hold the same bits, and a tolerance would
    let a step at an LLM's learning rate (1e-6) diverge unseen."""
    for key, when in (("_weights_before", "before"), ("_weights_after", "after")):
        sums = [res.pop(key, None) for res in results]
        if any(s is None for s in sums) or len(sums) < 2:
            continue  # not the first step, or nothing to compare (no torch module, sharded)
        odd = [r for r, s in enumerate(sums) if tuple(s) != tuple(sums[0])]
        if odd:
            raise _diverged(trainer, when, odd, sums, episode)


def _diverged(trainer: str, when: str, odd: list[int], sums: list[Any], episode: int) -> RankDivergenceError:
    shown = "; ".join(
        f"rank {r}: {int(s[0])} weights, sum {s[1]:.9g}, sum|w| {s[2]:.9g}, sum w^2 {s[3]:.9g}, hash {s[4][:12]}"
        for r, s in enumerate(sums)
        if r in (0, *odd)
    )
    if when == "before":
        why = (
            "they started from different weights; seed every rank alike in setup() (torch.manual_seed) or load "
            "one checkpoint"
        )
    else:
        why = (
            "their gradients were not summed over the ranks before the weights changed; hold the torch optimizer "
            "as an attribute of the model, made in setup() (flowrl then sums the gradients before each "
            "optimizer.step()), or call self.all_reduce_grads(module) before updating the weights (with "
            "auto_reduce_grads = False the trainer sums them itself: DDP or its own all-reduce); "
            "see docs/engine.md, Trainers"
        )
    return RankDivergenceError(
        f"trainer {trainer!r}: ranks {[0, *odd]} hold different weights {when} their first train step "
        f"(episode {episode}): {shown}. {why[0].upper()}{why[1:]}",
        trainer,
        [0, *odd],
        [sums[r] for r in (0, *odd)],
    )
