"""Training and weight sync of the RL engine (layer 6): global batches over a trainer's ranks,
and each trainer's weights sent to the inference model it feeds."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from .._backends.weight_share import Broadcast, Group
from .._core.batch import Batch, Sample
from .._core.sampler import plan_steps

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from pathlib import Path

    from .._backends.specs import ReplicaHandle
    from .._core.model import Model
    from .._core.run_config import RunConfig
    from .._core.trace import Timeline
    from .parts import Live


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
    _groups: dict[str, tuple[list[Any], Group]]  # per synced model: its last broadcast group and members

    async def _train(self, live: Live, model: Model, batch: Batch, episode: int, out: list[Any]) -> None:
        cfg, ranks = self.config, live.trainers[model.name]
        keys = batch["prompt_index"] if "prompt_index" in batch else None
        steps = plan_steps(
            len(batch),
            global_batch=cfg.global_batch,
            micro_batch=cfg.micro_batch,
            dp=len(ranks),
            group=cfg.num_samples_per_prompt,
            keys=keys,
        )
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
                    self.timeline.add(
                        model.name,
                        i,
                        "train_step",
                        started,
                        started + busy,
                        episode=episode,
                        samples=res["_samples"],
                        ids=batch.ids[step_rows[i]].tolist(),
                    )
                out.append(results)

    async def _sync(self, live: Live) -> None:
        for name, weights in await self._snapshots(live):
            await self._send(live, name, self._versions[name] + 1, weights)

    async def _snapshots(self, live: Live) -> list[tuple[str, Any]]:
        """Each trainer's weights now (stored: later steps do not change them), per target."""
        out, read = [], {}
        for trainer, target in self.sync_pairs:
            if trainer.name not in read:  # one snapshot per trainer, whatever the models it feeds
                read[trainer.name] = await self._read(live, trainer.name)
            out.append((target.name, read[trainer.name]))
            # a rebuild back to a checkpoint before this first sync needs the weights it replaces
            if self._folder is not None and self._versions[target.name] == 0 and target.name not in self._initial:
                self._initial[target.name] = await self._snapshot(live, target.name)
        return out

    async def _read(self, live: Live, trainer: str) -> Any:
        """What ``trainer``'s rank 0 sends: a reference to its weights, or (``"nccl"``) the
        ``Broadcast`` itself, which the driver addresses to each replica."""
        weights = await live.backend.get_weights(live.trainers[trainer][0])
        if next(t for t, _ in self.sync_pairs if t.name == trainer).config.weight_transport == "nccl":
            value = await live.backend.value(weights)  # small: the layout (in one process: the values)
            weights = value if isinstance(value, Broadcast) else weights
        return weights

    async def _send(self, live: Live, name: str, version: int, weights: Any) -> None:
        # Every replica loads between two of its shards (one worker thread per replica), and
        # the version counts only once all hold it: the staleness gate reads it.
        try:
            async with live.members:  # no replica joins or leaves meanwhile
                await self._deliver(live, name, version, weights, live.replicas_of(name), reuse=True)
        except BaseException:
            self._versions[name] = -1  # some replicas may hold it, some not: a restore sends again
            raise
        self._versions[name] = version
        self._sent[name] = weights

    async def _join(self, live: Live, handle: ReplicaHandle) -> None:
        """A replica added to a pool while the engine runs gets the weights the others hold."""
        if handle.model in self._sent:  # (called under live.members, like _send)
            await self._deliver(live, handle.model, self._versions[handle.model], self._sent[handle.model], [handle])

    async def _deliver(
        self, live: Live, name: str, version: int, weights: Any, handles: list[ReplicaHandle], reuse: bool = False
    ) -> None:
        """``weights`` to each of ``handles``: a reference they read, or (``Broadcast``) a
        broadcast from the trainer's rank 0 in a process group with them."""
        if not isinstance(weights, Broadcast):
            async with anyio.create_task_group() as tg:
                for handle in handles:
                    tg.start_soon(live.backend.load_weights, handle, version, weights)
            return
        rank0 = live.trainers[weights.trainer][0]
        group = await self._group(live, rank0, name, handles, weights.backend, reuse)
        keep = [g.id for _, g in self._groups.values()]  # those a later sync may use again
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(live.backend.send_weights, rank0, group, weights.snapshot, keep)
                for i, handle in enumerate(handles):
                    addressed = msgspec.structs.replace(weights, group=group, rank=i + 1)
                    tg.start_soon(live.backend.load_weights, handle, version, addressed)
        except BaseException:
            # some ranks may not have joined this broadcast: the next one forms a new group
            if reuse and self._groups.get(name, (None, None))[1] is group:
                del self._groups[name]
            raise

    async def _group(
        self, live: Live, rank0: ReplicaHandle, name: str, handles: list[ReplicaHandle], backend: str, reuse: bool
    ) -> Group:
        """The process group of a broadcast: the last one, when the same ranks make it (forming
        one costs a rendezvous and, with NCCL, a communicator), else a new one."""
        members = [backend, rank0.ref, *(h.ref for h in handles)]
        last = self._groups.get(name)
        if reuse and last is not None and last[0] == members:  # (list equality tries identity first)
            return last[1]
        group = await live.backend.serve_weights(rank0, len(handles) + 1, backend, self.config.collective_timeout_s)
        if reuse:  # a joining replica's own group does not replace the pool's
            self._groups[name] = members, group
        return group


def batch_of(samples: Sequence[Sample]) -> Batch:
    return Batch.from_samples([s.id for s in samples], [dict(s) for s in samples])
