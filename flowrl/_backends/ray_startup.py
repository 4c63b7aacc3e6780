"""The start of Ray actors, watched: each replica's or trainer rank's step of start-up (waiting
to be scheduled, in ``setup()``, connecting its channel) and, every
``PipelineConfig.startup_report_s``, a line for each one not ready yet saying which step it is in,
for how long, and what it waits for (a placement group not reserved, resources the cluster lacks
free). Without it a replica that never came up said nothing until ``setup_timeout_s``."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group_table

from .._core.errors import ClusterError
from .ray_wire import translate
from .specs import ActorCounts, ReplicaHandle

if TYPE_CHECKING:
    from collections.abc import Awaitable, Collection

    from .local_channel import ChannelServer, DriverEnd
    from .specs import ReplicaSpec

log = logging.getLogger("flowrl")
F = TypeVar("F", bound="asyncio.Future[Any]")


@dataclass
class Starting:
    """One actor's start: when it was asked for, and when each step ended (monotonic seconds)."""

    label: str  # policy[0], grpo[1]
    spec: ReplicaSpec
    asked: float
    scheduled: float | None = None  # its process runs (the actor's __init__ returned)
    set_up: float | None = None  # setup() returned
    channel: bool = False  # it opens a local channel (a replica on the driver's node)
    connected: float | None = None  # that channel is open
    pid: int = 0
    gpus: list[int] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.set_up is not None and (not self.channel or self.connected is not None)

    def step(self, now: float) -> str:
        """Where it is now, and for how long."""
        if self.scheduled is None:
            return f"not scheduled after {now - self.asked:.0f} s"
        if self.set_up is None:
            return (
                f"setup() running for {now - self.scheduled:.0f} s (pid {self.pid}, GPUs {self.gpus}; "
                f"scheduled after {self.scheduled - self.asked:.1f} s)"
            )
        return f"setup() done; its channel to the driver not connected after {now - self.set_up:.0f} s"

    def took_s(self) -> float:
        end = self.connected if self.connected is not None else self.set_up
        return 0.0 if end is None else end - self.asked

    def took(self) -> str:
        """How long each step took, once ready."""
        assert self.scheduled is not None and self.set_up is not None
        channel = f", channel {self.connected - self.set_up:.1f} s" if self.connected is not None else ""
        return (
            f"{self.label} ready in {self.took_s():.1f} s: scheduled after {self.scheduled - self.asked:.1f} s, "
            f"setup() {self.set_up - self.scheduled:.1f} s{channel} (pid {self.pid}, GPUs {self.gpus})"
        )


class StartupWatch:
    """The actors of one start call, and the reports on those not ready (``every`` seconds; 0:
    none). ``groups``: the backend's placement groups by name, to say what one waits for."""

    def __init__(self, every: float, groups: dict[str, Any]) -> None:
        self.every = every
        self.groups = groups
        self.clock = time.monotonic
        self.started = self.clock()
        self.actors: dict[Any, Starting] = {}  # by actor handle

    def asked(self, actor: Any, spec: ReplicaSpec) -> None:
        self.actors[actor] = Starting(f"{spec.model.name}[{spec.replica_id}]", spec, self.clock())

    async def scheduled(self, actor: Any, where: Awaitable[tuple[int, list[int]]]) -> None:
        """Wait for the actor's ``where()`` (answered once its process runs)."""
        s = self.actors[actor]
        s.pid, s.gpus = await where
        s.scheduled = self.clock()

    def set_up(self, actor: Any) -> None:
        self.actors[actor].set_up = self.clock()

    def opening(self, actor: Any) -> None:
        self.actors[actor].channel = True

    def connected(self, actor: Any) -> None:
        self.actors[actor].connected = self.clock()

    def finish(self) -> None:
        """Every actor is ready: those whose start outlasted a report interval say where their time went."""
        for s in self.actors.values():
            if self.every and s.ready and s.took_s() >= self.every:
                log.info("start-up: %s", s.took())

    async def wait(self, futures: Collection[F], within_s: float) -> set[F]:
        """Wait until every future is done, one fails, or ``within_s`` passed; report on the actors
        not ready every ``every`` seconds meanwhile. Returns the futures still pending."""
        deadline = self.clock() + within_s
        pending = set(futures)
        while pending:
            left = deadline - self.clock()
            if left <= 0:
                break
            tick = min(left, self.every) if self.every else left
            done, pending = await asyncio.wait(pending, timeout=tick, return_when=asyncio.FIRST_EXCEPTION)
            if any(not f.cancelled() and f.exception() is not None for f in done):
                break
            if pending and self.clock() < deadline:
                await self.report()
        return pending

    async def report(self) -> None:
        now = self.clock()
        # (label, step, its spec if not scheduled): taken before the await below, which others may change
        waiting = [
            (s.label, s.step(now), s.spec if s.scheduled is None else None) for s in self.actors.values() if not s.ready
        ]
        unscheduled = [spec for _, _, spec in waiting if spec is not None]
        reasons = iter(await anyio.to_thread.run_sync(self._waits_for, unscheduled) if unscheduled else [])
        ready = len(self.actors) - len(waiting)
        for label, step, spec in waiting:
            line = step if spec is None else f"{step}: {next(reasons)}"
            log.warning(
                "start-up, %.0f s, %d of %d ready: %s %s", now - self.started, ready, len(self.actors), label, line
            )

    def _waits_for(self, specs: list[ReplicaSpec]) -> list[str]:
        """What each actor not yet scheduled waits for (Ray's calls: on a thread)."""
        free: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]  # ray leaves it unannotated
        total: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        have = ", ".join(f"{free.get(r, 0.0):g} of {total.get(r, 0.0):g} {r}" for r in ("GPU", "CPU")) + " free"
        return [self._wait_of(spec, have) for spec in specs]

    def _wait_of(self, spec: ReplicaSpec, have: str) -> str:
        bundle = spec.bundle
        if bundle is None:
            return f"it asks for {spec.num_gpus:g} GPU and {spec.num_cpus:g} CPU; the cluster has {have}"
        pg = self.groups.get(bundle.group)
        state = str(placement_group_table(pg).get("state", "?")) if pg is not None else "not made"
        if state != "CREATED":
            shape = f"{bundle.size} bundle{'s' * (bundle.size != 1)} of {bundle.gpus:g} GPU and {bundle.cpus:g} CPU"
            return f"its placement group {bundle.group} ({shape}) is {state.lower()}: the cluster has {have}"
        return f"its placement group {bundle.group} is reserved; Ray is starting its process (the cluster has {have})"


def retrieved(fut: asyncio.Future[Any]) -> None:
    """Take a future's outcome so that asyncio does not log it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


async def set_up(spec: ReplicaSpec, actor: Any, counts: ActorCounts, watch: StartupWatch, *args: Any) -> ReplicaHandle:
    try:
        where = actor.where.remote()  # answered once its process runs, before setup() starts
        setup = actor.setup.remote(*args)
        await watch.scheduled(actor, where)
        node = await setup
    except (RayTaskError, RayActorError) as err:
        raise translate(err, f"{spec.model.name}.setup", spec.replica_id, []) from err
    watch.set_up(actor)
    counts.started(spec.model.name)
    return ReplicaHandle(spec.model.name, spec.replica_id, node, actor)


async def open_channels(
    server: ChannelServer, near: list[ReplicaHandle], watch: StartupWatch, timeout_s: float
) -> dict[Any, DriverEnd]:
    """The local channels of the replicas ``near`` the driver (on its node), by actor handle."""
    channels: dict[Any, DriverEnd] = {}

    async def connect(handle: ReplicaHandle) -> None:
        token = uuid.uuid4().hex
        end = server.expect(token)
        # A replica connects before its call returns; its end is ready once the loop accepts.
        await handle.ref.open_channel.remote(server.path, token)
        channels[handle.ref] = await end
        watch.connected(handle.ref)

    for h in near:
        watch.opening(h.ref)
    connecting = [asyncio.ensure_future(connect(h)) for h in near]
    try:
        pending = await watch.wait(connecting, timeout_s)
        for fut in connecting:
            if fut.done():
                fut.result()  # a failure, before the others' wait
        if pending:
            raise TimeoutError(f"not all connected within PipelineConfig.setup_timeout_s={timeout_s}s")
    except (TimeoutError, OSError, RayTaskError, RayActorError) as err:
        reason = err.cause if isinstance(err, RayTaskError) and isinstance(err.cause, BaseException) else err
        raise ClusterError(
            f"could not open the local channels of the replicas on the driver's node ({type(reason).__name__}: "
            f"{reason}); PipelineConfig.local_channels=False sends every shard as a Ray call instead"
        ) from err
    finally:
        for fut in connecting:
            fut.cancel()
            fut.add_done_callback(retrieved)
    return channels
