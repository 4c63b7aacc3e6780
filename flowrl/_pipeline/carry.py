"""Where a stage reads the fields that a loop's body updates (``flowrl.loop``'s state).

A field of a loop's state has several writers: the producer before the loop that first wrote
it, and the body stages that write it again each turn. Which one a stage reads is fixed by the
flow, never by timing:

- a stage after the loop reads the last writer in its view (flow order: the last update);
- a stage inside the body reads the last body stage upstream of it that writes the field (this
  turn's update), and when none is upstream, the value the turn started with: the one before
  the loop in turn 1, and then the last writer's output of the turn before (kept per sample
  when a turn ends, since a writer beside the reader may overwrite its output mid-turn).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._core.flow.graph import FlowGraph
    from .._core.flow.loops import LoopSpec


class Carry:
    """The static half of the rule above, over the fields each producer is known to write."""

    def __init__(self, graph: FlowGraph, fields: Mapping[str, frozenset[str]]) -> None:
        self._graph = graph
        self._fields = fields  # the ledger's: producer -> its fields, filled as producers report

    def _writes(self, producer: str, name: str) -> bool:
        return name in self._fields.get(producer, ())

    def state(self, spec: LoopSpec) -> set[str]:
        """The fields of ``spec``'s state (its input's, known so far): those its body may update."""
        return {f for p in self._graph.state_producers(spec) for f in self._fields.get(p, ())}

    def updated(self, spec: LoopSpec) -> list[str]:
        """The fields of ``spec``'s state that its body writes again (known so far)."""
        state = self.state(spec)
        return sorted({f for b in spec.body for f in self._fields.get(b, ()) if f in state})

    def needs(self, stage: str) -> set[str]:
        """The fields ``stage`` reads from a chosen writer: those two producers of its view
        write, and, inside a body, every field the body updates (its writer may be downstream)."""
        seen: dict[str, int] = {}
        for producer in self._graph.inputs_of(stage):
            for name in self._fields.get(producer, ()):
                seen[name] = seen.get(name, 0) + 1
        out = {name for name, count in seen.items() if count > 1}
        spec = self._graph.loop_of.get(stage)
        if spec is not None:
            out.update(self.updated(spec))
        return out

    def source(self, stage: str, name: str) -> str | None:
        """The producer whose output holds ``name`` for ``stage``; None: the value its turn
        started with (a body stage with no writer of it upstream)."""
        view = self._graph.inputs_of(stage)
        spec = self._graph.loop_of.get(stage)
        if spec is not None:
            view = tuple(p for p in view if p in spec.body)
        writers = [p for p in view if self._writes(p, name)]
        return writers[-1] if writers else None

    def before(self, spec: LoopSpec, name: str) -> str:
        """The producer holding ``name`` as the loop starts (the last writer before it)."""
        return [p for p in self._graph.state_producers(spec) if self._writes(p, name)][-1]

    def last(self, spec: LoopSpec, name: str) -> str | None:
        """The body stage whose output holds ``name`` when a turn ends (None: not updated)."""
        writers = [b for b in spec.body if self._writes(b, name)]
        return writers[-1] if writers else None
