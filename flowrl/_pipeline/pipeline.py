"""``AsyncPipeline``: a running flow, composed of the components of this package.

Each component owns its state and is handed its collaborators here:

- ``Supervisor``: the task group, the first failure, closed or not;
- ``Ledger``: the samples in flight, where their fields live, the join by sample id;
- ``AsyncPool`` per model: slots waiting for the scheduler's shards; ``Window``: the bound of
  every queue;
- ``Roster``: the replicas serving and their starvation; ``ShardCaller``: one shard call;
- ``Recovery``: shards sent again, outputs lost with a node computed again;
- ``Admission`` and ``Runs``: items into the window, samples out in order;
- ``Dispatcher``: the slots of every replica; ``Resizer`` and ``Autoscaler``: pools that
  grow and shrink.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio

from .._core import checks
from .._core.errors import PipelineClosedError, ReplicaDiedError
from .._core.observe.pipeline_stats import PipelineStats, StatsRecorder
from .._core.observe.trace import Timeline, chrome_trace, write_json
from .._core.scheduling.scheduler import PoolScheduler
from .admission import Admission
from .autoscaler import Autoscaler
from .blocks import place_blocks
from .calls import ShardCaller
from .dispatch import Dispatcher
from .ledger import Ledger
from .parts import Joining, Parts, Replacements
from .pools import AsyncPool, Window
from .progress import log, mode, run_line, watch_run
from .recovery import Recovery
from .resizer import Resizer
from .roster import Roster
from .runs import Runs
from .supervisor import Supervisor

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Iterable
    from pathlib import Path

    from anyio.abc import TaskGroup

    from .._backends.abc import Backend
    from .._backends.specs import ReplicaHandle
    from .._core.flow.batch import Sample
    from .._core.flow.graph import FlowGraph
    from .._core.scheduling.autoscale import Reading, ScaleEvent
    from .._core.settings.config import PipelineConfig
    from .inflight import Run
    from .runs import Items

View = tuple[str, dict[str, int], anyio.CancelScope | None]


def _pools(graph: FlowGraph, deterministic: bool = False) -> dict[str, AsyncPool]:
    pools = {}
    for name, model in graph.models.items():
        cfg = model.config
        sched = PoolScheduler(
            replicas=cfg.replicas,
            policy=cfg.splitter,
            prefetch=cfg.prefetch,
            deterministic=deterministic,
            clock=time.monotonic,
            merges=model.merges_shards,
        )
        c = model.config.call_cost
        prior = None if c is None else (c.fixed_s, c.per_sample_s)
        for stage in graph.stages_of(name):
            sched.add_stage(stage, model.config.batch_size, prior, model.config.shard_micro_batches)
        pools[name] = AsyncPool(sched)
    return pools


class AsyncPipeline:
    """A running flow: ``await pipe.run(items)``, ``async for s in pipe.stream(items)``,
    ``pipe.stats()``, ``pipe.placement``. Get one from ``flowrl.open_pipeline``."""

    def __init__(
        self,
        graph: FlowGraph,
        backend: Backend,
        config: PipelineConfig,
        handles: list[ReplicaHandle],
        joining: Joining | None = None,
    ) -> None:
        self.graph = graph
        self.config = config
        self.timeline = Timeline(config.trace_spans)  # a span per shard, as its replica timed it
        self._supervisor = Supervisor()
        self._pools = _pools(graph, config.deterministic)
        self._recorder = StatsRecorder(
            {s.name: s.model for s in graph.stages.values()}, {n: m.config.replicas for n, m in graph.models.items()}
        )
        self._ledger = Ledger(graph, config)
        if config.deterministic:
            place_blocks(graph, self._ledger, self._pools)  # shards are fixed blocks of each run's samples
        self._roster = Roster(handles, self._recorder)
        self._replacements = Replacements(self._pools, graph)
        parts = Parts(
            graph=graph,
            config=config,
            backend=backend,
            ledger=self._ledger,
            pools=self._pools,
            window=Window(config.max_inflight),
            roster=self._roster,
            recorder=self._recorder,
            timeline=self.timeline,
            supervisor=self._supervisor,
            replacements=self._replacements,
            joining=joining or Joining(),
        )
        call = ShardCaller(parts)
        self._recovery = recovery = Recovery(parts, call)
        self._runs = Runs(parts, Admission(parts), recovery)
        self._dispatcher = Dispatcher(parts, call, recovery, self._runs)
        self._resizer = Resizer(parts, self._dispatcher, self._runs)
        self._autoscaler = Autoscaler(parts, self._resizer, self._runs)

    # ---- lifecycle (driven by ``running``) ----
    def start(self, tg: TaskGroup) -> None:
        """Start every replica's slots, and the autoscaler if a model asks for one, in ``tg``."""
        self._supervisor.attach(tg)
        for handle in self._roster.handles:
            self._dispatcher.serve(handle)
        tg.start_soon(self._resizer.replace)  # replicas in place of those whose calls hung
        if self._autoscaler.configs:
            tg.start_soon(self._autoscaler.run)

    def close(self) -> None:
        self._supervisor.closed = True

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the pipeline, if one did."""
        return self._supervisor.error

    # ---- runs ----
    async def run(
        self,
        items: Items,
        *,
        ordered: bool | None = None,
        fields: Iterable[str] | None = None,
        costs: Iterable[float] | None = None,
        ids: Iterable[int] | None = None,
    ) -> list[Sample]:
        """Run every item through the flow; the finished samples, in input order by default."""
        stream = self.stream(items, ordered=ordered, fields=fields, costs=costs, ids=ids)
        try:
            return [s async for s in stream]
        finally:
            await stream.aclose()

    async def stream(
        self,
        items: Items,
        *,
        ordered: bool | None = None,
        fields: Iterable[str] | None = None,
        costs: Iterable[float] | None = None,
        ids: Iterable[int] | None = None,
    ) -> AsyncGenerator[Sample, None]:
        """Yield finished samples as the flow produces them (input order unless ``ordered=False``).

        ``fields`` limits what comes back to the driver: only the objects holding those fields
        are fetched; everything else stays in the object store. ``costs``: an estimate of each
        item's cost (e.g. its response length last epoch), one per item: every stage takes the
        costliest pending samples first, and a shard holds samples of similar cost (as
        ``PipelineConfig.cost_field``, which it replaces for this run). ``ids``: each item's
        sample id (distinct, none in flight), in place of numbering on from the last run (a later
        run is numbered after the highest id used): a sample's random streams follow its id, so
        a run of some items again under their old ids draws what they drew (an engine replaying
        a recorded schedule does so).
        """
        wanted = checks.field_names(fields, "AsyncPipeline.stream(fields=...)")
        estimates = checks.item_costs(costs, items, "AsyncPipeline.stream(costs=...)")
        chosen = checks.item_ids(ids, items, "AsyncPipeline.stream(ids=...)")
        run = await self._runs.begin(ordered, wanted, items, estimates, chosen)
        view = self._show(run)
        try:
            async for sample in self._runs.deliver(run):
                yield sample
        finally:
            self._runs.abandon(run)
            self._shown(run, view)

    def _show(self, run: Run) -> View | None:
        """Start the run's progress view (``PipelineConfig.progress``)."""
        shown = mode(self.config.progress)
        if shown == "off":
            return None
        base = {name: s.samples for name, s in self.stats().stages.items()}
        scope = anyio.CancelScope() if shown == "live" else None
        if scope is not None:
            self._supervisor.start_soon(watch_run, self, run, base, scope)
        return shown, base, scope

    def _shown(self, run: Run, view: View | None) -> None:
        if view is None:
            return
        shown, base, scope = view
        if scope is not None:
            scope.cancel()
        if shown == "log" and run.admission_done and run.finished == run.admitted:
            log.info(run_line(self, run, base))

    async def settle(self) -> None:
        """Stop the current run's admission and wait until what it admitted has finished (its
        samples are dropped): then the pipeline can be renumbered (``resume_at``)."""
        await self._runs.settle()

    def resume_at(self, next_id: int, next_run: int) -> None:
        """Number the next sample ``next_id`` and the next run (a step's ``iteration``)
        ``next_run``: an engine resuming from a checkpoint continues both."""
        if self._ledger.samples or self._runs.running():
            raise PipelineClosedError("a pipeline can only be renumbered while no run is in progress")
        self._ledger.renumber(next_id)
        for pool in self._pools.values():
            pool.scheduler.forget_suspects()  # ids are used again
        self._runs.count = next_run

    def numbering(self) -> tuple[int, int]:
        """(the next sample's id, the next run's number)."""
        return self._ledger.next_id, self._runs.count

    # ---- what is running, and its counters ----
    @property
    def placement(self) -> dict[str, list[str]]:
        """Node id of each replica, per model."""
        out: dict[str, list[str]] = {m: [""] * pool.scheduler.replicas for m, pool in self._pools.items()}
        for h in self._roster.handles:
            out[h.model][h.replica_id] = h.node_id
        return out

    def replicas_of(self, model: str) -> list[ReplicaHandle]:
        """``model``'s replicas, but those whose process died."""
        return self._roster.of(model)

    def retire(self, handle: ReplicaHandle, err: ReplicaDiedError) -> bool:
        """``handle``'s process died outside a shard (an engine's weight sync met it): it is
        retired as if it had died in a shard, and False if it is not one of this pipeline's
        replicas. ReplicaDiedError, and the pipeline fails, if it was its model's last."""
        if handle not in self._roster.handles:
            return False
        try:
            self._recovery.retire(handle, err)
        except ReplicaDiedError as last:
            self._supervisor.fail(last)  # a run waiting on this pool wakes with it
            raise
        return True

    def busy(self) -> dict[str, tuple[int, int]]:
        """Per model: (replicas running a shard now, replicas serving)."""
        out = {}
        for name, pool in self._pools.items():
            s = pool.scheduler
            serving = s.serving_ids()
            out[name] = (sum(1 for r in serving if s.in_flight[r]), len(serving))
        return out

    def stats(self) -> PipelineStats:
        """Counters so far; a stream in progress counts its time up to now."""
        queues = {stage: q for pool in self._pools.values() for stage, q in pool.scheduler.queues().items()}
        waiting = self._roster.waiting(time.perf_counter())  # starved until now
        serving = {name: len(self.serving(name)) for name in self._pools}
        return self._recorder.snapshot(
            extra_active_s=self._runs.live_s(), queues=queues, starving=waiting, serving=serving
        )

    def write_trace(self, path: str | Path) -> Path:
        """Write the pipeline's timeline as a Chrome trace (JSON; Perfetto opens it)."""
        return write_json(checks.file_path(path, "AsyncPipeline.write_trace(path)"), chrome_trace(self.timeline.spans))

    # ---- elastic pools ----
    def serving(self, model: str) -> list[int]:
        """The replicas of ``model`` serving now (neither removed nor dead)."""
        return self._resizer.serving(model)

    async def resize(
        self, model: str, replicas: int, *, reason: str = "requested", reading: Reading | None = None
    ) -> list[int]:
        """Grow or shrink ``model``'s pool to ``replicas`` serving; the ids added or removed."""
        return await self._resizer.resize(model, replicas, reason=reason, reading=reading)

    async def add_replicas(self, model: str, count: int = 1) -> list[int]:
        """Start ``count`` replicas of ``model``; they pull shards as soon as they are set up."""
        return await self._resizer.add_replicas(model, count)

    async def remove_replicas(self, model: str, count: int = 1) -> list[int]:
        """Stop ``count`` replicas of ``model`` (the least busy, then the newest): each is cut no
        new shard, finishes those it holds, then its actor stops."""
        return await self._resizer.remove_replicas(model, count)

    async def healed(self) -> None:
        """Returns once no replica is starting in place of one that died or hung (at once if
        none is): each pool is then back at its size, but the replicas left out."""
        await self._replacements.settled()

    @property
    def scale_events(self) -> list[ScaleEvent]:
        return self._resizer.scale_events
