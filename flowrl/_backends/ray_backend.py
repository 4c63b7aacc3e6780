"""The Ray backend: one Ray actor per replica (``ray_actors``). It, the actors, ``ray_wire`` (how shard data and
replies travel) and ``ray_shipping`` are the only modules that import ray. Replicas on the driver's node also read
shards from a Unix socket (``local_channel``), which costs far less than a Ray call."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import uuid
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError
from ray.util.metrics import Gauge
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .._core.errors import ClusterError, InputLostError, ReplicaDiedError
from .._core.flow.batch import Batch, approx_nbytes
from .._core.settings.config import CallMeta, PipelineConfig, ShardCall, decode_meta, encode_message
from .local_channel import ERR, ChannelLost, ChannelServer, DriverEnd
from .ray_actors import ReplicaActor, TrainerActor
from .ray_shipping import check_picklable, ship_by_value
from .ray_startup import StartupWatch, open_channels, retrieved, set_up
from .ray_wire import (
    INLINE_BYTES,
    Inline,
    Replies,
    Reply,
    by_value,
    call_args,
    frame,
    local,
    open_stored,
    raise_remote,
    translate,
    unframe,
)
from .specs import ActorCounts, Bundle, ReplicaHandle, ReplicaSpec, check_capacity

if TYPE_CHECKING:
    from .weight_share import Group


# Pipelines of this process that use a cluster flowrl started; the last one to close stops it.
_owned = {"started": False, "users": 0}


ALIVE_TIMEOUT_S = 30.0  # a live actor answers a ping in milliseconds; a dead one fails once Ray sees it gone
_GAUGES: dict[str, Gauge] = {}  # one per metric name for the process: Ray registers each name once


def live_actor_names() -> list[str]:
    """Names of the live Ray actors flowrl started (empty when every pipeline is closed)."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("flowrl-"))


def _ray_nodes() -> list[dict[str, Any]]:
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]  # ray leaves it unannotated
    return nodes


async def _ask(handle: ReplicaHandle, method: str, stage: str, *args: Any) -> Any:
    """``handle``'s actor method, its failures as FlowErrors naming ``<model>.<stage>``."""
    try:
        return await getattr(handle.ref, method).remote(*args)
    except (RayTaskError, RayActorError) as err:
        raise translate(err, f"{handle.model}.{stage}", handle.replica_id, []) from err


async def _kill(actors: list[Any]) -> None:
    for actor in actors:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(actor, no_restart=True)
    with anyio.move_on_after(30):  # until each is really gone, so that no flowrl actor outlives the pipeline
        for actor in actors:
            with contextlib.suppress(RayActorError, GetTimeoutError):
                await actor.ping.remote()


class RayBackend:
    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.counts = ActorCounts()
        self._reserving: list[asyncio.Future[None]] = []  # placement groups not reserved yet
        self._owner = False
        self._connected = False
        self._actors: list[Any] = []
        self._groups: dict[str, Any] = {}
        self._names: dict[str, int] = {}
        self._tag = uuid.uuid4().hex[:8]
        self._replies = Replies()
        self._server: ChannelServer | None = None
        self._channels: dict[Any, DriverEnd] = {}  # by actor handle
        self._picklable: set[int] = set()  # ids of the models checked by check_picklable

    def _connect(self, specs: list[ReplicaSpec]) -> None:
        if self._connected:
            return
        self._connected = True
        if not ray.is_initialized():
            address = self.config.ray_address or os.environ.get("RAY_ADDRESS")
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
            if address:
                ray.init(address=address, **kwargs)
            else:
                # An embedded cluster gets enough logical CPUs for the pools it is started for:
                # replicas mostly wait on accelerators, so CPU tokens only gate placement.
                cpus = self.config.ray_init_cpus or max(os.cpu_count() or 1, math.ceil(sum(s.num_cpus for s in specs)))
                # address="local": a new cluster, never one found running on this machine (give
                # PipelineConfig.ray_address or RAY_ADDRESS to use one)
                ray.init(address="local", num_cpus=cpus, num_gpus=self.config.ray_init_gpus, **kwargs)
            _owned["started"] = True
        if _owned["started"]:
            _owned["users"] += 1
            self._owner = True

    async def prepare(self, specs: list[ReplicaSpec]) -> None:
        for model in {id(s.model): s.model for s in specs if id(s.model) not in self._picklable}.values():
            ship_by_value(model)  # what the actors will unpickle, checked as they will get it
            check_picklable(model)
            self._picklable.add(id(model))
        await anyio.to_thread.run_sync(self._connect, specs)
        nodes = [n.get("Resources", {}) for n in _ray_nodes() if n.get("Alive")]
        total: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]  # ray leaves it unannotated
        check_capacity(specs, total, nodes)

    async def start(self, specs: list[ReplicaSpec]) -> list[ReplicaHandle]:
        await self.prepare(specs)
        watch = StartupWatch(self.config.startup_report_s, self._groups)
        waits, actors = {}, {}
        for s in specs:
            actor = self._create(ReplicaActor, s, s.model, s.replica_id, self.config.deterministic)
            watch.asked(actor, s)
            future = asyncio.ensure_future(set_up(s, actor, self.counts, watch))
            waits[future], actors[future] = s, actor
        try:
            pending = await watch.wait(list(waits), self.config.setup_timeout_s)
        except BaseException:  # cancelled (the pipeline closes while they start): they stop, quietly
            for fut in waits:
                fut.cancel()
                fut.add_done_callback(retrieved)
            raise
        failed = [err for f in waits if f not in pending and (err := f.exception()) is not None]
        for fut in pending:
            fut.cancel()
        self._forget_reserving()
        if failed or pending:  # none of this call's actors is left holding resources
            await self.stop([ReplicaHandle(s.model.name, s.replica_id, "", actors[f]) for f, s in waits.items()])
        if failed:
            raise failed[0]
        if pending:
            late = ", ".join(sorted(f"{waits[f].model.name}[{waits[f].replica_id}]" for f in pending))
            raise ClusterError(
                f"replicas {late} did not start within PipelineConfig.setup_timeout_s={self.config.setup_timeout_s}s "
                "(the cluster may lack a resource they ask for, or setup() hangs)"
            )
        handles = [f.result() for f in waits]
        self.counts.reserved.update(s.bundle.group for s in specs if s.bundle is not None)  # their actors run
        await self._open_channels(handles, watch)
        watch.finish()
        return handles

    async def _open_channels(self, handles: list[ReplicaHandle], watch: StartupWatch) -> None:
        here = ray.get_runtime_context().get_node_id()
        near = [h for h in handles if h.node_id == here] if self.config.local_channels else []
        if not near:
            return
        if self._server is None:
            self._server = ChannelServer()
            await self._server.start()
        self._channels |= await open_channels(self._server, near, watch, self.config.setup_timeout_s)

    def _create(self, cls: Any, spec: ReplicaSpec, *args: Any) -> Any:
        ship_by_value(spec.model)
        name = f"flowrl-{self._tag}-{spec.model.name}-{spec.replica_id}"
        self._names[name] = self._names.get(name, 0) + 1
        if self._names[name] > 1:  # the same model in a second flow (evaluation) gets its own pool
            name = f"{name}-{self._names[name]}"
        options: dict[str, Any] = {
            "name": name,
            "namespace": self.config.ray_namespace,
            "num_cpus": spec.num_cpus,
            "num_gpus": spec.num_gpus,
        }
        if spec.model.merges_shards and cls is ReplicaActor:  # its shards' Ray calls run at once
            options["max_concurrency"] = spec.model.config.prefetch + 1
        if spec.bundle is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group(spec.bundle), placement_group_bundle_index=spec.bundle.index
            )
        actor = cls.options(**options).remote(*args)
        self._actors.append(actor)
        return actor

    def _placement_group(self, bundle: Bundle) -> Any:
        pg = self._groups.get(bundle.group)
        if pg is None:
            shape = {"GPU": bundle.gpus, "CPU": bundle.cpus}
            pg = placement_group([dict(shape) for _ in range(bundle.size)], strategy="PACK")
            self._groups[bundle.group] = pg
            self._reserving.append(asyncio.ensure_future(self._reserved(bundle.group, pg)))
        return pg

    async def _reserved(self, group: str, pg: Any) -> None:
        await pg.ready()
        self.counts.reserved.add(group)

    def _forget_reserving(self) -> None:  # their actors have started (or failed to): no more to show
        for fut in self._reserving:
            fut.cancel()
        self._reserving.clear()

    async def start_trainer(self, specs: list[ReplicaSpec], timeout_s: float) -> list[ReplicaHandle]:
        await self.prepare(specs)
        watch = StartupWatch(self.config.startup_report_s, self._groups)
        ranks = [
            self._create(TrainerActor, s, s.model, s.replica_id, len(specs), self.config.deterministic) for s in specs
        ]
        for s, r in zip(specs, ranks, strict=True):
            watch.asked(r, s)

        async def start_ranks() -> list[ReplicaHandle]:
            try:
                init = await ranks[0].rendezvous.remote() if len(ranks) > 1 else None
            except (RayTaskError, RayActorError) as err:  # the rendezvous itself failed
                raise translate(err, f"{specs[0].model.name}.setup", 0, []) from err
            setups = (set_up(s, r, self.counts, watch, init, timeout_s) for s, r in zip(specs, ranks, strict=True))
            return list(await asyncio.gather(*setups))

        starting = asyncio.ensure_future(start_ranks())
        try:
            if await watch.wait([starting], self.config.setup_timeout_s):
                raise ClusterError(
                    f"trainer {specs[0].model.name!r}: its {len(specs)} ranks did not start within "
                    f"PipelineConfig.setup_timeout_s={self.config.setup_timeout_s}s (the cluster may lack a "
                    "resource they ask for, or setup() hangs)"
                )
            handles = starting.result()
        except BaseException:  # a rank that died in setup, or a timeout: none of the group stays
            with anyio.CancelScope(shield=True):
                gone = {id(r) for r in ranks}
                self._actors = [a for a in self._actors if id(a) not in gone]
                await _kill(ranks)
            raise
        finally:
            starting.cancel()
            starting.add_done_callback(retrieved)
            self._forget_reserving()
        watch.finish()
        return handles

    async def train(
        self, rank: ReplicaHandle, shard: Any, ids: list[int], step_size: int, micro_batch: int, iteration: int
    ) -> dict[str, Any]:
        self.counts.training_started(rank.model)
        try:  # the shard reference is resolved by Ray inside the rank's process
            metrics: dict[str, Any] = await rank.ref.train.remote(by_value(shard), step_size, micro_batch, iteration)
            return metrics
        except (RayTaskError, RayActorError) as err:
            raise translate(err, f"{rank.model}.train_step", rank.replica_id, ids) from err
        finally:
            self.counts.training_ended(rank.model)

    async def get_weights(self, rank: ReplicaHandle) -> Any:
        # Two returns, both owned by the driver: the small one tells of a failure at once, the
        # weights stay in the object store unread and outlive the process that made them (a
        # replica replaced while its trainer is rebuilt still reads what the others hold).
        done, weights = rank.ref.get_weights.remote()
        try:
            await done
        except (RayTaskError, RayActorError) as err:
            raise translate(err, f"{rank.model}.get_weights", rank.replica_id, []) from err
        return weights

    async def load_weights(self, replica: ReplicaHandle, version: int, weights: Any) -> None:
        await _ask(replica, "load_weights", "set_weights", version, weights)

    async def serve_weights(self, rank: ReplicaHandle, world: int, backend: str, timeout_s: float) -> Group:
        group: Group = await _ask(rank, "serve_weights", "weight broadcast", world, backend, timeout_s)
        return group

    async def send_weights(self, rank: ReplicaHandle, group: Group, snapshot: int, keep: list[str]) -> None:
        await _ask(rank, "send_weights", "weight broadcast", group, snapshot, keep)

    async def save_state(self, rank: ReplicaHandle, alone: bool = False) -> tuple[bytes | None, bytes]:
        state: tuple[bytes | None, bytes] = await _ask(rank, "save_state", "checkpoint_state", alone)
        return state

    async def load_state(self, rank: ReplicaHandle, model: bytes, rng: bytes | None) -> None:
        await _ask(rank, "load_state", "restore_state", model, rng)

    async def value(self, ref: Any) -> Any:
        return await ref

    def share(self, value: Any) -> Any:
        return ray.put(value)

    def stored(self, ref: Any) -> bool:
        return not isinstance(ref, (Inline, Reply))  # those are held by the driver

    def export_metrics(self, values: list[tuple[str, str, dict[str, str], float]]) -> None:
        for name, description, tags, value in values:
            gauge = _GAUGES.get(name)
            if gauge is None:
                gauge = _GAUGES[name] = Gauge(name, description=description, tag_keys=tuple(sorted(tags)))
            gauge.set(value, tags=tags)

    def dead_nodes(self) -> set[str]:
        return {n["NodeID"] for n in _ray_nodes() if not n.get("Alive")}

    async def alive(self, handle: ReplicaHandle) -> bool:
        try:  # a trainer rank answers on its control thread, even while blocked in a collective
            with anyio.fail_after(ALIVE_TIMEOUT_S):
                answered: bool = await handle.ref.ping.remote()
                return answered
        except (RayActorError, TimeoutError):
            return False

    async def stop(self, handles: list[ReplicaHandle]) -> None:
        gone = {id(h.ref) for h in handles}
        self._actors = [a for a in self._actors if id(a) not in gone]
        await _kill([h.ref for h in handles])

    async def free(self) -> dict[str, float]:
        return await anyio.to_thread.run_sync(ray.available_resources)

    def put(self, batch: Batch) -> Any:
        if approx_nbytes(batch) <= INLINE_BYTES:
            return Inline(batch)
        return ray.put(batch)

    async def call(self, replica: ReplicaHandle, call: ShardCall) -> tuple[CallMeta, Any]:
        refs, body, pieces = call_args(call)
        blob = frame(encode_message(msgspec.structs.replace(call, pieces=pieces)), body)
        end = self._channels.get(replica.ref)
        if not refs and end is not None and end.usable():  # every row it reads is in the driver
            return await self._call_over(end, replica, call, blob)
        head_ref, big_ref = replica.ref.run.remote(blob, *refs)
        try:
            reply = await self._replies.wait(head_ref)
        except (RayTaskError, RayActorError, ObjectLostError) as err:
            with contextlib.suppress(Exception):  # consume the twin error, or Ray logs it as unhandled
                await big_ref
            raise translate(err, call.stage, replica.replica_id, call.ids) from err
        head, rows = unframe(reply)
        return decode_meta(head), Reply(head_ref, reply) if len(rows) else big_ref

    async def _call_over(
        self, end: DriverEnd, replica: ReplicaHandle, call: ShardCall, blob: bytes
    ) -> tuple[CallMeta, Any]:
        seq, future = end.send(blob)
        try:
            data = memoryview(await future)
        except ChannelLost as err:
            raise ReplicaDiedError(
                f"the replica's process died: {err}", call.stage, replica.replica_id, call.ids
            ) from err
        if data[:1] == ERR:
            raise_remote(data[1:], call.stage, replica.replica_id, call.ids)
        head, rows = unframe(data[1:])
        meta = decode_meta(head)
        return meta, Inline(blob=bytes(rows), rows=meta.rows) if len(rows) else replica.ref.take.remote(seq)

    async def fetch(self, refs: list[Any]) -> list[Batch]:
        stored = [r for r in refs if not isinstance(r, (Inline, Reply))]
        try:
            fetched = dict(zip(stored, await asyncio.gather(*stored), strict=True)) if stored else {}
        except ObjectLostError as err:
            raise InputLostError(
                f"an output to deliver was lost with the node that stored it ({type(err).__name__})"
            ) from err
        return [local(r) if isinstance(r, (Inline, Reply)) else open_stored(fetched[r]) for r in refs]

    async def close(self) -> None:
        self._forget_reserving()
        await anyio.to_thread.run_sync(self._replies.close)
        for end in self._channels.values():
            end.close()
        self._channels.clear()
        if self._server is not None:
            self._server.close()
            self._server = None
        actors, self._actors = self._actors, []
        await _kill(actors)
        for pg in self._groups.values():
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self._groups.clear()
        if self._owner:
            self._owner = False
            _owned["users"] -= 1
            if _owned["users"] == 0 and ray.is_initialized():
                _owned["started"] = False
                ray.shutdown()
