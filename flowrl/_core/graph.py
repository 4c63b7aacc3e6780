"""Flow tracing and validation (sans-IO).

A flow is a plain function over model handles. It is called once with a placeholder
``Node`` for the input; every step call on a placeholder records a stage instead of running.
The result is a ``FlowGraph``: stages in call order (a topological order), their inputs, and
which producers' fields each stage sees (the union over its inputs: samples are joined by id).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import FlowDefinitionError
from .node import Node, StepInfo

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from .model import Model

SOURCE = "input"


@dataclass(frozen=True)
class StageSpec:
    name: str
    model: str
    method: str
    inputs: tuple[str, ...]
    reads: frozenset[str] | None = None
    writes: frozenset[str] | None = None


@dataclass
class _Builder:
    stages: dict[str, StageSpec] = field(default_factory=dict)
    models: dict[str, Model] = field(default_factory=dict)

    def add_stage(
        self, model: Model, method: str, args: tuple[object, ...], kwargs: dict[str, object], info: StepInfo
    ) -> Node:
        where = f"{model.name}.{method}"
        if kwargs:
            raise FlowDefinitionError(
                f"{where}: inside a flow, pass stage outputs positionally; got keyword arguments {sorted(kwargs)}"
            )
        nodes: list[Node] = []
        for pos, arg in enumerate(args):
            if not isinstance(arg, Node):
                raise FlowDefinitionError(
                    f"{where}: argument {pos} must be the flow input or another stage's output, "
                    f"got {type(arg).__name__}"
                )
            if arg._builder is not self:
                raise FlowDefinitionError(f"{where}: argument {pos} comes from a different flow")
            nodes.append(arg)
        known = self.models.setdefault(model.name, model)
        if known is not model:
            raise FlowDefinitionError(
                f"two different models are named {model.name!r}; model names must be unique in a flow"
            )
        count = sum(1 for s in self.stages.values() if s.model == model.name and s.method == method)
        name = where if count == 0 else f"{where}#{count + 1}"
        inputs = tuple(dict.fromkeys(n._name for n in nodes))
        self.stages[name] = StageSpec(name, model.name, method, inputs, info.reads, info.writes)
        return Node(self, name)


class FlowGraph:
    """The traced DAG: stages, the models behind them, and the flow's output producers."""

    def __init__(self, stages: Mapping[str, StageSpec], models: Mapping[str, Model], outputs: tuple[str, ...]) -> None:
        self.stages = dict(stages)
        self.models = dict(models)
        self.outputs = outputs
        self._visible: dict[str, tuple[str, ...]] = {SOURCE: (SOURCE,)}
        for spec in self.stages.values():
            seen: dict[str, None] = {}
            for i in spec.inputs:
                seen.update(dict.fromkeys(self._visible[i]))
            seen[spec.name] = None
            self._visible[spec.name] = tuple(seen)
        out: dict[str, None] = {}
        for o in outputs:
            out.update(dict.fromkeys(self._visible[o]))
        self.output_producers = tuple(out)
        # Looked up for every shard on the driver: computed once here.
        self._inputs = {s: tuple(p for p in self._visible[s] if p != s) for s in self.stages}
        self._consumers = {n: [s for s in self.stages.values() if n in s.inputs] for n in (SOURCE, *self.stages)}

    def visible(self, node: str) -> tuple[str, ...]:
        """Producers whose fields a sample carries after ``node`` (``node`` included)."""
        return self._visible[node]

    def inputs_of(self, stage: str) -> tuple[str, ...]:
        """Producers whose fields ``stage`` reads: the union over its inputs."""
        return self._inputs[stage]

    def consumers(self, node: str) -> list[StageSpec]:
        """The stages that take ``node`` (a stage or the input) as a direct input."""
        return self._consumers[node]

    def stages_of(self, model: str) -> list[str]:
        return [s.name for s in self.stages.values() if s.model == model]

    def cohabitants(self, producer: str) -> set[str]:
        """Producers that appear next to ``producer`` in some sample view (stage or output)."""
        views = [self._visible[s] for s in self.stages] + [self.output_producers]
        return {p for view in views if producer in view for p in view if p != producer}

    def validate(self, input_fields: Iterable[str] | None) -> None:
        """Check declared reads and writes; undeclared ones are checked when data flows."""
        declared: dict[str, frozenset[str] | None] = {SOURCE: None if input_fields is None else frozenset(input_fields)}
        declared.update({s.name: s.writes for s in self.stages.values()})
        views = [(f"stage {s!r}", self._visible[s]) for s in self.stages]
        views.append(("the flow's output", self.output_producers))
        for where, view in views:
            _check_unique_writers(where, view, declared)
        for spec in self.stages.values():
            _check_reads(spec, self.inputs_of(spec.name), declared)


def _describe(producer: str) -> str:
    return "the flow input" if producer == SOURCE else f"stage {producer!r}"


def _check_unique_writers(where: str, view: tuple[str, ...], declared: Mapping[str, frozenset[str] | None]) -> None:
    owner: dict[str, str] = {}
    for producer in view:
        for f in sorted(declared[producer] or ()):
            if f in owner:
                raise FlowDefinitionError(
                    f"field {f!r} is written by both {_describe(owner[f])} and {_describe(producer)} "
                    f"(both seen by {where}); a field must have one writer — rename one of them"
                )
            owner[f] = producer


def _check_reads(spec: StageSpec, producers: tuple[str, ...], declared: Mapping[str, frozenset[str] | None]) -> None:
    if spec.reads is None or any(declared[p] is None for p in producers):
        return  # not every upstream declares its fields: checked at run time instead
    available = {f: p for p in producers for f in declared[p] or ()}
    missing = sorted(spec.reads - available.keys())
    if missing:
        have = ", ".join(f"{f!r} (from {_describe(p)})" for f, p in sorted(available.items())) or "none"
        raise FlowDefinitionError(
            f"stage {spec.name!r} reads field(s) {missing} that no upstream stage writes; its inputs provide: {have}"
        )


def trace(flow: Callable[[Node], Any]) -> FlowGraph:
    """Run ``flow`` once on a placeholder input and return its graph."""
    if not callable(flow):
        raise FlowDefinitionError(f"a flow must be a function of one argument, got {type(flow).__name__}")
    check_one_argument(flow, "flow", "the flow input, e.g. `def flow(prompts):`")
    builder = _Builder()
    result = flow(Node(builder, SOURCE))
    nodes = result if isinstance(result, (tuple, list)) else (result,)
    if not nodes or not all(isinstance(n, Node) and n._builder is builder for n in nodes):
        raise FlowDefinitionError(f"a flow must return the output of a stage (or a tuple of them), got {result!r}")
    if not builder.stages:
        raise FlowDefinitionError("the flow calls no model step; call at least one, e.g. policy.forward_step(prompts)")
    return FlowGraph(builder.stages, builder.models, tuple(dict.fromkeys(n._name for n in nodes)))


def check_one_argument(fn: Callable[..., Any], what: str, argument: str) -> None:
    """Refuse ``fn`` when it cannot be called with one argument, naming it and its signature, before
    a bare TypeError from the call would (a wrong ``rollout=``, ``eval_flow=`` or relay function is
    found when it is given, not when it first runs)."""
    if not callable(fn):
        raise FlowDefinitionError(f"{what} must be a function of one argument ({argument}), got {type(fn).__name__}")
    if hasattr(fn, "__flowrl_step__"):  # a model's step as the flow (``run_flow(policy.forward_step, ...)``)
        return  # its signature is the replica's (batch, iteration); given a stage output, it records a stage
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables have none: the call will tell
        return
    try:
        signature.bind(SOURCE)
    except TypeError as err:
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        raise FlowDefinitionError(
            f"{what} {name}{signature} cannot be called with one argument ({argument}): {err}"
        ) from None
