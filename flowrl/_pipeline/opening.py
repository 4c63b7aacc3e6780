"""Opening and closing pipelines: the async context manager and the sync wrapper."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread

from .._backends.select import make_backend
from .._backends.specs import ReplicaSpec, default_spec
from .._core.checks import field_names, file_path, item_costs, item_source
from .._core.errors import FlowError, PipelineClosedError
from .._core.flow.graph import FlowGraph, trace
from .._core.flow.model import Model
from .._core.flow.node import Node
from .._core.settings.config import PipelineConfig, to_config
from .blocks import check_deterministic
from .pipeline import AsyncPipeline

if TYPE_CHECKING:
    from pathlib import Path

    from .._backends.abc import Backend
    from .._core.flow.batch import Sample
    from .._core.observe.pipeline_stats import PipelineStats
    from .._core.observe.trace import Timeline
    from .parts import Joining

Flow = Callable[[Node], Any]


def build_flow(flow: Flow, input_fields: Iterable[str] | None = None) -> FlowGraph:
    """Trace ``flow`` and check what can be checked before anything starts."""
    graph = trace(flow)
    graph.validate(field_names(input_fields, "input_fields"))
    return graph


SpecFn = Callable[[Model, int], ReplicaSpec]


def replica_specs(graph: FlowGraph, make_spec: SpecFn = default_spec) -> list[ReplicaSpec]:
    return [make_spec(model, r) for model in graph.models.values() for r in range(model.config.replicas)]


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error to show for a failed task group: its first non-cancellation leaf."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        elif not isinstance(exc, cancelled) and all(exc is not seen for seen in leaves):
            leaves.append(exc)

    walk(group)
    if not leaves:
        return group
    first = leaves[0]
    for other in leaves[1:]:
        first.add_note(f"also failed at the same time: {other!r}")
    return first


@contextlib.asynccontextmanager
async def plain_errors() -> AsyncIterator[None]:
    """Show a failed task group as the error that caused it (a FlowError), not as a group."""
    try:
        yield
    except BaseExceptionGroup as group:
        error = _first_error(group)
        if error is group:
            raise
        raise error from error.__cause__


@contextlib.asynccontextmanager
async def running(
    graph: FlowGraph,
    backend: Backend,
    config: PipelineConfig,
    place: SpecFn = default_spec,
    joining: Joining | None = None,
) -> AsyncIterator[AsyncPipeline]:
    """Start ``graph``'s pools on ``backend`` (each replica where ``place`` says) and run their
    pullers until the block exits; ``joining``: how a replica added later joins."""
    check_deterministic(graph, config)  # before any replica starts
    async with anyio.create_task_group() as tg:
        handles = await backend.start(replica_specs(graph, place))
        pipe = AsyncPipeline(graph, backend, config, handles, joining)
        pipe.start(tg)
        try:
            yield pipe
        finally:
            pipe.close()
            tg.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def open_pipeline(
    flow: Flow,
    config: PipelineConfig | Mapping[str, Any] | None = None,
    *,
    input_fields: Iterable[str] | None = None,
) -> AsyncIterator[AsyncPipeline]:
    """Trace ``flow``, start every model's pool, and yield a pipeline to stream samples through.

    All replicas are stopped when the block exits, also on error or cancellation. An error in
    any stage fails the block promptly with a ``FlowError`` naming stage, replica and samples.
    """
    cfg = to_config(PipelineConfig, config, "pipeline config")
    graph = build_flow(flow, input_fields)
    backend = make_backend(cfg)
    try:
        async with plain_errors(), running(graph, backend, cfg) as pipe:
            yield pipe
    finally:
        with anyio.CancelScope(shield=True):
            await backend.close()


class Pipeline:
    """The synchronous face of a pipeline, for scripts::

    with flowrl.Pipeline(rollout) as pipe:
        samples = pipe.run(items)
        print(pipe.stats())
    """

    def __init__(
        self,
        flow: Flow,
        config: PipelineConfig | Mapping[str, Any] | None = None,
        *,
        input_fields: Iterable[str] | None = None,
    ) -> None:
        self._args = (flow, config, input_fields)
        self._stack: contextlib.ExitStack | None = None
        self._pipe: AsyncPipeline | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._reported: BaseException | None = None

    def __enter__(self) -> Pipeline:
        flow, config, input_fields = self._args
        stack = contextlib.ExitStack()
        try:
            self._portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
            cm = self._portal.wrap_async_context_manager(open_pipeline(flow, config, input_fields=input_fields))
            self._pipe = stack.enter_context(cm)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc_info: Any) -> None:
        stack, self._stack = self._stack, None
        if stack is None:
            return
        failure = self._pipe.failure if self._pipe is not None else None
        try:
            stack.__exit__(*exc_info)
        except BaseException as err:
            # The portal may report a failed pipeline as a cancellation: show the real error,
            # unless the caller has already seen it.
            real = err if isinstance(err, FlowError) or failure is None else failure
            if real is self._reported or real is exc_info[1]:
                return
            if real is err:
                raise
            raise real from None

    def run(
        self,
        items: Iterable[Mapping[str, Any]],
        *,
        ordered: bool | None = None,
        fields: Iterable[str] | None = None,
        costs: Iterable[float] | None = None,
    ) -> list[Sample]:
        """Run ``items`` through the flow and return the finished samples (only ``fields``, if
        given); ``costs``: an estimate per item (see ``AsyncPipeline.stream``)."""
        if self._stack is None or self._pipe is None or self._portal is None:
            raise PipelineClosedError("use the pipeline inside `with flowrl.Pipeline(...) as pipe:`")
        item_source(items, "Pipeline.run(items=...)")
        field_names(fields, "Pipeline.run(fields=...)")
        estimates = item_costs(costs, items, "Pipeline.run(costs=...)")
        pipe = self._pipe
        try:
            return self._portal.call(lambda: pipe.run(items, ordered=ordered, fields=fields, costs=estimates))
        except Exception as err:
            self._reported = err  # seen by the caller: not raised again when the block exits
            raise

    def stats(self) -> PipelineStats:
        if self._pipe is None:
            raise FlowError("the pipeline is not open")
        return self._pipe.stats()

    @property
    def placement(self) -> dict[str, list[str]]:
        if self._pipe is None:
            raise FlowError("the pipeline is not open")
        return self._pipe.placement

    @property
    def timeline(self) -> Timeline:
        """A span per shard (``timeline.spans``), as its replica timed it; also after the block."""
        if self._pipe is None:
            raise FlowError("the pipeline was never opened")
        return self._pipe.timeline

    def write_trace(self, path: str | Path) -> Path:
        """Write the timeline (a span per shard) as a Chrome trace; also after the block."""
        if self._pipe is None:
            raise FlowError("the pipeline was never opened")
        return self._pipe.write_trace(file_path(path, "Pipeline.write_trace(path)"))


def run_flow(
    flow: Flow,
    items: Iterable[Mapping[str, Any]],
    config: PipelineConfig | Mapping[str, Any] | None = None,
    *,
    input_fields: Iterable[str] | None = None,
) -> tuple[list[Sample], PipelineStats]:
    """One call for scripts: open a pipeline, run ``items`` once, close it."""
    item_source(items, "run_flow(items=...)")  # before any replica starts
    with Pipeline(flow, config, input_fields=input_fields) as pipe:
        return pipe.run(items), pipe.stats()
