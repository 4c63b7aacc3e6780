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

from ..errors import FlowDefinitionError
from .loops import LoopSpec
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
class _OpenLoop:
    name: str
    entry: str
    stages: list[str] = field(default_factory=list)


@dataclass
class _Builder:
    stages: dict[str, StageSpec] = field(default_factory=dict)
    models: dict[str, Model] = field(default_factory=dict)
    loops: dict[str, LoopSpec] = field(default_factory=dict)
    in_body: dict[str, str] = field(default_factory=dict)  # a closed loop's stage -> the loop
    open: _OpenLoop | None = None

    def _input(self, where: str, pos: int, node: Node) -> str:
        """The node a stage reads, as recorded: a loop's state placeholder is its entry."""
        name = node._name
        body = self.open
        if body is not None:
            if name == f"{body.name}:state":
                return body.entry
            if name not in body.stages:
                raise FlowDefinitionError(
                    f"{where}: argument {pos} comes from outside the body of loop {body.name!r}; a step inside "
                    "a loop reads only the loop's state and other steps of the body (what the body needs "
                    "from before the loop reaches it through the state)"
                )
        if body is None and name.endswith(":state"):
            raise FlowDefinitionError(
                f"{where}: argument {pos} is the state of loop {name.removesuffix(':state')!r}, which exists only "
                "inside that loop's body; after the loop, read the loop's output"
            )
        if body is None and name in self.in_body:
            raise FlowDefinitionError(
                f"{where}: argument {pos} is a step inside loop {self.in_body[name]!r}; after the loop, "
                "read the loop's output (what flowrl.loop returned)"
            )
        return name

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
            nodes.append(Node(self, self._input(where, pos, arg)))
        known = self.models.setdefault(model.name, model)
        if known is not model:
            raise FlowDefinitionError(
                f"two different models are named {model.name!r}; model names must be unique in a flow"
            )
        count = sum(1 for s in self.stages.values() if s.model == model.name and s.method == method)
        name = where if count == 0 else f"{where}#{count + 1}"
        inputs = tuple(dict.fromkeys(n._name for n in nodes))
        self.stages[name] = StageSpec(name, model.name, method, inputs, info.reads, info.writes)
        if self.open is not None:
            self.open.stages.append(name)
        return Node(self, name)

    def add_loop(
        self,
        body: Callable[[Node], Any],
        state: Node,
        until: str,
        max_turns: int,
        deadline_s: float | None,
        name: str,
    ) -> Node:
        if state._builder is not self:
            raise FlowDefinitionError("flowrl.loop: its state comes from a different flow")
        if self.open is not None:
            raise FlowDefinitionError(f"flowrl.loop {name!r} is inside loop {self.open.name!r}: loops do not nest")
        if name in self.loops:
            raise FlowDefinitionError(f"two loops are named {name!r}; give one another name (flowrl.loop(name=...))")
        entry = self._input(f"flowrl.loop {name!r}", 1, state)
        self.open = _OpenLoop(name, entry)
        try:
            result = body(Node(self, f"{name}:state"))
            opened = self.open
        finally:
            self.open = None
        spec = _close_loop(opened, self.stages, result, until, max_turns, deadline_s)
        self.loops[name] = spec
        self.in_body.update(dict.fromkeys(spec.body, name))
        return Node(self, spec.exit)


def _close_loop(
    opened: _OpenLoop,
    stages: Mapping[str, StageSpec],
    result: object,
    until: str,
    max_turns: int,
    deadline_s: float | None,
) -> LoopSpec:
    """The loop's spec once its body is traced: the body returned the output of one of its
    steps, and every step of the body leads to it (a turn ends when that step is done)."""
    name = opened.name
    if not isinstance(result, Node) or result._name not in opened.stages:
        raise FlowDefinitionError(
            f"the body of loop {name!r} must return the output of a step called inside it, got {result!r}"
        )
    leads = {result._name}
    for stage in reversed(opened.stages):
        if stage in leads:
            leads.update(i for i in stages[stage].inputs if i in opened.stages)
    stray = [s for s in opened.stages if s not in leads]
    if stray:
        raise FlowDefinitionError(
            f"loop {name!r}: step(s) {stray} of the body do not lead to the step it returns "
            f"({result._name!r}); a turn ends when that step is done, so every step of the body must feed it"
        )
    return LoopSpec(name, opened.entry, tuple(opened.stages), result._name, until, max_turns, deadline_s)


class FlowGraph:
    """The traced DAG: stages, the models behind them, and the flow's output producers."""

    def __init__(
        self,
        stages: Mapping[str, StageSpec],
        models: Mapping[str, Model],
        outputs: tuple[str, ...],
        loops: Mapping[str, LoopSpec] | None = None,
    ) -> None:
        self.stages = dict(stages)
        self.models = dict(models)
        self.outputs = outputs
        self.loops = dict(loops or {})
        self.loop_of = {s: spec for spec in self.loops.values() for s in spec.body}  # a body stage -> its loop
        self.loop_ended_by = {spec.result: spec for spec in self.loops.values()}
        self.loops_from: dict[str, list[LoopSpec]] = {}  # a loop's entry node -> the loops it feeds
        for each in self.loops.values():
            self.loops_from.setdefault(each.entry, []).append(each)
        self._visible: dict[str, tuple[str, ...]] = {SOURCE: (SOURCE,)}
        for spec in self.stages.values():
            seen: dict[str, None] = {}
            for i in spec.inputs:
                seen.update(dict.fromkeys(self._visible[i]))
            seen[spec.name] = None
            self._visible[spec.name] = tuple(seen)
            if spec.name in self.loop_ended_by:  # after the loop: what its last turn left
                self._visible[self.loop_ended_by[spec.name].exit] = self._visible[spec.name]
        out: dict[str, None] = {}
        for o in outputs:
            out.update(dict.fromkeys(self._visible[o]))
        self.output_producers = tuple(out)
        # Looked up for every shard on the driver: computed once here.
        self._inputs = {s: tuple(p for p in self._visible[s] if p != s) for s in self.stages}
        exits = [spec.exit for spec in self.loops.values()]
        self._consumers = {
            n: [s for s in self.stages.values() if n in s.inputs] for n in (SOURCE, *self.stages, *exits)
        }
        # Per view (a stage's input, or the output): the loops whose body it sees, whose
        # updated fields it reads from their latest writer.
        self._loops_seen = {
            view: tuple(spec for spec in self.loops.values() if any(b in producers for b in spec.body))
            for view, producers in [*((s, self._inputs[s] + (s,)) for s in self.stages), ("", self.output_producers)]
        }
        self.visits = len(self.stages) + len(self.loops)  # a finished sample's ``done``: every stage, every exit

    def visible(self, node: str) -> tuple[str, ...]:
        """Producers whose fields a sample carries after ``node`` (``node`` included)."""
        return self._visible[node]

    def inputs_of(self, stage: str) -> tuple[str, ...]:
        """Producers whose fields ``stage`` reads: the union over its inputs."""
        return self._inputs[stage]

    def consumers(self, node: str) -> list[StageSpec]:
        """The stages that take ``node`` (a stage or the input) as a direct input."""
        return self._consumers[node]

    def loops_seen(self, stage: str) -> tuple[LoopSpec, ...]:
        """The loops whose body ``stage`` is in or after ("" for the flow's output)."""
        return self._loops_seen[stage]

    def turn_starts(self, spec: LoopSpec) -> list[StageSpec]:
        """The stages of ``spec``'s body that read only its state: each turn starts there."""
        return [s for s in self.consumers(spec.entry) if s.name in spec.body]

    def state_producers(self, spec: LoopSpec) -> tuple[str, ...]:
        """The producers of a loop's state: the fields a body stage may update."""
        return self._visible[spec.entry]

    def updates(self, a: str, b: str) -> LoopSpec | None:
        """The loop in which producers ``a`` and ``b`` may write one field: one updates the
        other's (a body stage and a state producer, or two body stages in turn)."""
        for spec in (self.loop_of.get(b), self.loop_of.get(a)):  # a later loop may update an earlier one's
            if spec is not None and all(p in spec.body or p in self.state_producers(spec) for p in (a, b)):
                return spec
        return None

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
        for loop in self.loops.values():  # a loop's last step also carries its record
            writes = declared[loop.result]
            if writes is not None:
                declared[loop.result] = writes | {loop.turns_field, loop.stop_field}
        views = [(f"stage {s!r}", self._visible[s]) for s in self.stages]
        views.append(("the flow's output", self.output_producers))

        def may_update(a: str, b: str, name: str) -> bool:
            """Inside a loop, a body stage may write a field of the loop's state again."""
            spec = self.updates(a, b)
            if spec is None:
                return False
            state = [declared[p] for p in self.state_producers(spec)]
            return any(fields is None or name in fields for fields in state)  # undeclared: checked at run time

        for where, view in views:
            _check_unique_writers(where, view, declared, may_update)
        for spec in self.stages.values():
            _check_reads(spec, self.inputs_of(spec.name), declared)


def _describe(producer: str) -> str:
    return "the flow input" if producer == SOURCE else f"stage {producer!r}"


def _check_unique_writers(
    where: str,
    view: tuple[str, ...],
    declared: Mapping[str, frozenset[str] | None],
    may_update: Callable[[str, str, str], bool],
) -> None:
    owner: dict[str, str] = {}
    for producer in view:
        for f in sorted(declared[producer] or ()):
            if f in owner and not may_update(owner[f], producer, f):
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
    outputs = tuple(dict.fromkeys(builder._input("the flow's output", pos, n) for pos, n in enumerate(nodes)))
    return FlowGraph(builder.stages, builder.models, outputs, builder.loops)


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
