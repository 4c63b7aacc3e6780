"""Training and weight sync of the RL engine (layer 6): global batches over a trainer's ranks,
and each trainer's weights sent to the inference model it feeds."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from ._backend import ReplicaHandle
from ._batch import Batch, Sample
from ._engine_parts import Live
from ._model import Model
from ._run_config import RunConfig
from ._sampler import plan_steps
from ._trace import Timeline


class Training:
    """The training half of ``Engine``: ``_train`` one trainer on a batch, ``_sync`` weights."""

    config: RunConfig
    sync_pairs: list[tuple[Model, Model]]
    timeline: Timeline
    _counts: dict[str, dict[int, list[float]]]
    _versions: dict[str, int]
    _sent: dict[str, Any]
    _initial: dict[str, Any]
    _folder: Path | None
    _snapshot: Callable[[Live, str], Awaitable[Any]]  # Resumable's

    async def _train(self, live: Live, model: Model, batch: Batch, episode: int, out: list[Any]) -> None:
        cfg, ranks = self.config, live.trainers[model.name]
        keys = batch["prompt_index"] if "prompt_index" in batch else None
        steps = plan_steps(len(batch), global_batch=cfg.global_batch, micro_batch=cfg.micro_batch,
                           dp=len(ranks), group=cfg.num_samples_per_prompt, keys=keys)
        # each rank's shard goes to the object store once per episode, whatever the epochs
        rows = [[[r for mb in rank for r in mb] for rank in s.ranks] for s in steps]
        shards = [[live.backend.put(batch.select(rank)) for rank in step_rows] for step_rows in rows]
        counts = self._counts[model.name]
        for _ in range(cfg.num_training_epoch):
            for step, refs, step_rows in zip(steps, shards, rows):
                results: list[Any] = [None] * len(ranks)

                async def one(i: int, ref: Any, ids: list[int], size: int = step.size) -> None:
                    results[i] = await live.backend.train(ranks[i], ref, ids, size, cfg.micro_batch, episode)

                async with anyio.create_task_group() as tg:
                    for i, ref in enumerate(refs):
                        tg.start_soon(one, i, ref, batch.ids[step_rows[i]].tolist())
                for i, res in enumerate(results):
                    c, busy, started = counts.setdefault(i, [0, 0, 0.0]), res.pop("_busy_s"), res.pop("_started")
                    c[0], c[1], c[2] = c[0] + res["_samples"], c[1] + 1, c[2] + busy
                    self.timeline.add(model.name, i, "train_step", started, started + busy, episode=episode,
                                      samples=res["_samples"], ids=batch.ids[step_rows[i]].tolist())
                out.append(results)

    async def _sync(self, live: Live) -> None:
        for name, weights in await self._snapshots(live):
            await self._send(live, name, self._versions[name] + 1, weights)

    async def _snapshots(self, live: Live) -> list[tuple[str, Any]]:
        """Each trainer's weights now (stored: later steps do not change them), per target."""
        out = []
        for trainer, target in self.sync_pairs:
            out.append((target.name, await live.backend.get_weights(live.trainers[trainer.name][0])))
            # a rebuild back to a checkpoint before this first sync needs the weights it replaces
            if self._folder is not None and self._versions[target.name] == 0 and target.name not in self._initial:
                self._initial[target.name] = await self._snapshot(live, target.name)
        return out

    async def _send(self, live: Live, name: str, version: int, weights: Any) -> None:
        # Every replica loads between two of its shards (one worker thread per replica), and
        # the version counts only once all hold it: the staleness gate reads it.
        try:
            async with live.members, anyio.create_task_group() as tg:  # no replica joins or leaves meanwhile
                for handle in live.replicas_of(name):
                    tg.start_soon(live.backend.load_weights, handle, version, weights)
        except BaseException:
            self._versions[name] = -1  # some replicas may hold it, some not: a restore sends again
            raise
        self._versions[name] = version
        self._sent[name] = weights

    async def _join(self, live: Live, handle: ReplicaHandle) -> None:
        """A replica added to a pool while the engine runs gets the weights the others hold."""
        if handle.model in self._sent:  # (called under live.members, like _send)
            await live.backend.load_weights(handle, self._versions[handle.model], self._sent[handle.model])


def batch_of(samples: Sequence[Sample]) -> Batch:
    return Batch.from_samples([s.id for s in samples], [dict(s) for s in samples])
