"""Weight sync: each trainer's weights sent to the inference model it feeds, through
the object store (by host or CUDA IPC handles) or broadcast from the trainer's rank 0 (NCCL)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from .._backends.weight_share import Broadcast, Group
from .._core.errors import CheckpointError, ReplicaDiedError, StageError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .._backends.specs import ReplicaHandle
    from .._core.flow.model import Model
    from .._core.settings.run_config import RunConfig
    from .deployment import Deployment
    from .replay import Replay

Snapshots = list[tuple[str, Any]]  # (inference model, the weights it is to get)
Deaths = list[tuple["ReplicaHandle", ReplicaDiedError]]  # replicas that died loading weights


class WeightSync:
    """Owns what each synced inference model holds: its weight version (-1: unknown, some
    replicas may hold a newer one), the weights last sent to it, the broadcast group its
    replicas last formed, and, once a checkpoint exists, its weights from before its first sync."""

    def __init__(
        self, config: RunConfig, pairs: list[tuple[Model, Model]], deployment: Deployment, watch: Replay | None = None
    ) -> None:
        self.config = config
        self.pairs = pairs
        self.deployment = deployment
        self._versions = {target.name: 0 for _, target in pairs}
        self._sent: dict[str, Any] = {}
        self.groups: dict[str, tuple[list[Any], Group]] = {}  # model -> (members, group) of its last broadcast
        self._first: dict[str, Any] = {}  # model -> its weights before the first sync (or the error reading them)
        self._keep_first = False
        self._touched: set[str] = set()  # models some replica of which may have loaded a sync
        self.watch = watch  # a replayed schedule: told of each sync, may hold it back

    @property
    def versions(self) -> dict[str, int]:
        """The weight version every replica of each synced model holds now."""
        return dict(self._versions)

    def sent(self, model: str) -> Any:
        """The weights ``model``'s replicas hold (a reference, or a ``Broadcast``)."""
        return self._sent[model]

    def keep_first_weights(self) -> None:
        """A checkpoint exists to go back to: from now on, keep each model's weights from before
        its first sync, which a rebuild back to a checkpoint before that sync gives back."""
        self._keep_first = True

    async def sync(self) -> None:
        await self.send_all([(name, self._versions[name] + 1, weights) for name, weights in await self.snapshots()])

    async def send_all(self, sends: list[tuple[str, int, Any]]) -> None:
        """Each (model, version, weights), one model after another. Under a replayed schedule
        each model's sync waits on its own (``Replay.before_send``): a recorded sample may have
        met one model's new version and another's old one, which an order fixed here would
        not give."""
        if self.watch is None:
            for name, version, weights in sends:
                await self.send(name, version, weights)
            return
        async with anyio.create_task_group() as tg:
            for name, version, weights in sends:
                tg.start_soon(self.send, name, version, weights)

    async def snapshots(self) -> Snapshots:
        """Each trainer's weights now (stored: later steps do not change them), per target."""
        out, read = [], {}
        for trainer, target in self.pairs:
            if trainer.name not in read:  # one snapshot per trainer, whatever the models it feeds
                read[trainer.name] = await self._read(trainer.name)
            out.append((target.name, read[trainer.name]))
            if self._keep_first and self._versions[target.name] == 0 and target.name not in self._first:
                self._first[target.name] = await self._replica_weights(target.name)
        return out

    async def send(self, name: str, version: int, weights: Any, restoring: bool = False) -> None:
        # Every replica loads between two of its shards (one worker thread per replica), and
        # the version counts only once all hold it: the staleness gate reads it.
        deployment = self.deployment
        if self.watch is not None and not restoring:  # a restore gives back what was held: nothing to wait for
            await self.watch.before_send(name, version)
        self._touched.add(name)
        try:
            async with deployment.members:  # no replica joins or leaves meanwhile
                await self._deliver_all(name, version, weights)
        except BaseException:
            self._versions[name] = -1  # some replicas may hold it, some not: a restore sends again
            raise
        self._versions[name] = version
        self._sent[name] = weights
        if self.watch is not None:
            self.watch.sent(name, version)

    async def _deliver_all(self, name: str, version: int, weights: Any) -> None:
        """``weights`` to every live replica of ``name``. One that dies meanwhile is retired from
        its pool, as a death in a shard would retire it; those left that a broadcast it broke
        did not reach take part in a new one. Each round retires a replica, so rounds are few."""
        handles, reuse = self.deployment.replicas_of(name), True
        while handles:
            dead, handles = await self._deliver(name, version, weights, handles, reuse)
            for handle, err in dead:
                self.deployment.retire(handle, err)  # its pool's last replica: ReplicaDiedError
            reuse = False  # a broadcast sent again forms a group of its own

    async def join(self, handle: ReplicaHandle) -> None:
        """A replica added to a pool while the engine runs gets the weights the others hold."""
        if handle.model in self._sent:  # (called under deployment.members, like send)
            model = handle.model
            dead, _ = await self._deliver(model, self._versions[model], self._sent[model], [handle])
            if dead:  # not serving yet: the resize fails, and its replicas stop
                raise dead[0][1]

    def forget(self, trainer: str) -> None:
        """``trainer``'s process is gone, and what it sent with it: the models it feeds get their
        weights again (``restore``) whatever version they hold."""
        for source, target in self.pairs:
            if source.name == trainer:
                self._versions[target.name] = -1

    async def rehome(self, trainer: str) -> None:
        """``trainer``'s ranks were started again from a survivor, at the state they had: the
        models it feeds keep their weights, but what was sent by CUDA IPC or NCCL lived in the old
        rank 0, so a replica joining later gets them from a live replica, by host memory."""
        for source, target in self.pairs:
            if source.name == trainer and source.config.weight_transport != "host" and target.name in self._sent:
                weights = await self._replica_weights(target.name)
                if isinstance(weights, StageError):
                    raise weights
                self._sent[target.name] = weights
                self.groups.pop(target.name, None)

    async def restore(self, trainer: str, target: str, want: int, saved: Callable[[], Any] | None) -> None:
        """Give ``target``'s replicas the weights of version ``want``, held at a checkpoint:
        ``saved`` reads them from it when it has them (it falls between two syncs)."""
        # a broadcast's snapshot was the old trainer's: a replica joining later needs one of the new
        rebuilt = isinstance(self._sent.get(target), Broadcast)
        if want == self._versions[target] and not rebuilt:
            return  # they hold them already (a fresh start, or no sync since the checkpoint)
        if want == 0 and target not in self._touched:
            self._versions[target] = 0  # nothing was ever sent to them: they hold the weights they started with
            return
        if saved is not None:
            weights = self.deployment.backend.share(saved())
        elif want:  # written right after a sync: the restored trainer's weights are the ones sent
            weights = await self._read(trainer)
        else:
            weights = self._first_weights(target)
        await self.send(target, want, weights, restoring=True)

    def _first_weights(self, target: str) -> Any:
        weights = self._first.get(target)
        if weights is None or isinstance(weights, StageError):
            why = (
                "they were not read"
                if weights is None
                else f"reading them failed ({weights}); define get_weights on it"
            )
            raise CheckpointError(
                f"cannot give model {target!r} back the weights it started with (the checkpoint predates its "
                f"first sync): {why}"
            ) from weights
        return weights

    async def _replica_weights(self, name: str) -> Any:
        """``name``'s weights now, read from a replica; the error, if it cannot give them."""
        try:
            return await self.deployment.backend.get_weights(self.deployment.replicas_of(name)[0])
        except StageError as err:
            return err

    async def _read(self, trainer: str) -> Any:
        """What ``trainer``'s rank 0 sends: a reference to its weights, or (``"nccl"``) the
        ``Broadcast`` itself, which the driver addresses to each replica. Every rank is asked,
        at once, so that a sharded model can gather its full weights collectively."""
        backend = self.deployment.backend
        ranks = self.deployment.trainers[trainer]
        read: list[Any] = [None] * len(ranks)

        async def one(i: int) -> None:
            read[i] = await backend.get_weights(ranks[i])

        async with anyio.create_task_group() as tg:  # every rank at once: a sharded model gathers
            for i in range(len(ranks)):
                tg.start_soon(one, i)
        weights = read[0]
        if next(t for t, _ in self.pairs if t.name == trainer).config.weight_transport == "nccl":
            value = await backend.value(weights)  # small: the layout (in one process: the values)
            weights = value if isinstance(value, Broadcast) else weights
        return weights

    async def _deliver(
        self, name: str, version: int, weights: Any, handles: list[ReplicaHandle], reuse: bool = False
    ) -> tuple[Deaths, list[ReplicaHandle]]:
        """``weights`` to each of ``handles``: a reference they read, or (``Broadcast``) a
        broadcast from the trainer's rank 0 in a process group with them. Returns the replicas
        that died meanwhile and those a broadcast must reach again (it failed for them because
        of a death); any other failure raises."""
        backend = self.deployment.backend
        if not isinstance(weights, Broadcast):
            loads = await _each([partial(backend.load_weights, h, version, weights) for h in handles])
            _raise_first([err for err in loads if not _died(err)])  # a user's set_weights raising
            return _deaths(handles, loads), []
        rank0 = self.deployment.trainers[weights.trainer][0]
        group = await self._group(rank0, name, handles, weights.backend, reuse)
        keep = [g.id for _, g in self.groups.values()]  # those a later sync may use again
        addressed = [msgspec.structs.replace(weights, group=group, rank=i + 1) for i in range(len(handles))]
        sent, *loads = await _each(
            [
                partial(backend.send_weights, rank0, group, weights.snapshot, keep),
                *(partial(backend.load_weights, h, version, w) for h, w in zip(handles, addressed, strict=True)),
            ]
        )
        if (sent or any(loads)) and self.groups.get(name, (None, None))[1] is group:
            del self.groups[name]  # some ranks may not have joined this broadcast: never use it again
        dead = _deaths(handles, loads)
        if not dead:
            _raise_first([sent, *loads])
        # a death breaks the collective for the others: those it failed for try again without it
        return dead, [h for h, err in zip(handles, loads, strict=True) if err is not None and not _died(err)]

    async def _group(
        self, rank0: ReplicaHandle, name: str, handles: list[ReplicaHandle], backend: str, reuse: bool
    ) -> Group:
        """The process group of a broadcast: the last one, when the same ranks make it (forming
        one costs a rendezvous and, with NCCL, a communicator), else a new one."""
        members = [backend, rank0.ref, *(h.ref for h in handles)]
        last = self.groups.get(name)
        if reuse and last is not None and last[0] == members:  # (list equality tries identity first)
            return last[1]
        timeout = self.config.collective_timeout_s
        group = await self.deployment.backend.serve_weights(rank0, len(handles) + 1, backend, timeout)
        if reuse:  # a joining replica's own group does not replace the pool's
            self.groups[name] = members, group
        return group


async def _each(calls: list[Callable[[], Awaitable[None]]]) -> list[Exception | None]:
    """Await every call at once, each to its end: one replica's failure must not cancel the
    others' loads (their remote calls would run on, unseen). Each call's error, or None."""
    errors: list[Exception | None] = [None] * len(calls)

    async def one(i: int) -> None:
        try:
            await calls[i]()
        except Exception as err:
            errors[i] = err

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(one, i)
    return errors


def _died(err: Exception | None) -> bool:
    return isinstance(err, ReplicaDiedError)


def _deaths(handles: list[ReplicaHandle], loads: list[Exception | None]) -> Deaths:
    """The replicas whose process died loading, with their errors."""
    return [(h, err) for h, err in zip(handles, loads, strict=True) if isinstance(err, ReplicaDiedError)]


def _raise_first(errors: list[Exception | None]) -> None:
    for err in errors:
        if err is not None:
            raise err
