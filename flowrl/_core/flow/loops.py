"""Loops in a flow: a body of stages repeated per sample until a field says it is done.

``flowrl.loop(body, state, until="done", max_turns=8)`` traces ``body`` once on a placeholder
for the loop's state. Each sample runs the body again and again, one turn at a time, each
turn scheduled on its own (a replica that finishes a turn of one sample pulls the next ready
turn of any sample), until the body's last stage returns ``until`` true for it, or it has run
``max_turns`` turns, or ``deadline_s`` has passed since it entered the loop.

The state carries from turn to turn by updates: a body stage may return a field that the
loop's input already has (``text``, a transcript that grows), and the next turn reads the
new value. Every other field a body stage adds lives for its turn only; after the loop, its
consumers see the last turn's. This module holds what the tracer and the runtime share: the
loop's description and the columns its last stage reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, FlowDefinitionError
from ..names import NAME_RULE, check_name
from .node import Node

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

# Why a sample left its loop, in the ``<loop>_stop`` column.
DONE = "done"  # its ``until`` field was true
MAX_TURNS = "max_turns"
DEADLINE = "deadline"


@dataclass(frozen=True)
class LoopSpec:
    """A traced loop: ``state`` and ``exit`` are placeholder node names (they hold no fields)."""

    name: str
    entry: str  # the node that feeds the loop (the flow input or a stage)
    body: tuple[str, ...]  # its stages, in flow order
    result: str  # the body's last stage: it reports ``until`` and ends the turn
    until: str
    max_turns: int
    deadline_s: float | None

    @property
    def state(self) -> str:
        return f"{self.name}:state"

    @property
    def exit(self) -> str:
        return f"{self.name}:out"

    @property
    def turns_field(self) -> str:
        return f"{self.name}_turns"

    @property
    def stop_field(self) -> str:
        return f"{self.name}_stop"


def loop(
    body: Callable[[Node], Node],
    state: Node,
    *,
    until: str,
    max_turns: int,
    deadline_s: float | None = None,
    name: str = "loop",
) -> Node:
    """Repeat ``body`` for each sample of ``state`` until its ``until`` field is true.

    ``body`` is a function of one placeholder (the loop's state) that calls model steps and
    returns the last one's output; that step must return the boolean field ``until``. A
    sample ends after ``max_turns`` turns, or once ``deadline_s`` seconds have passed since it
    entered the loop (checked when a turn's last step is called; a call in progress is
    bounded by ``call_timeout_s``). The output carries ``<name>_turns`` (turns run) and
    ``<name>_stop`` ("done", "max_turns" or "deadline"). Loops do not nest.
    """
    if not isinstance(state, Node):
        raise FlowDefinitionError(
            f"flowrl.loop(body, state, ...): state must be the flow input or a stage output, got {type(state).__name__}"
        )
    if not callable(body):
        raise FlowDefinitionError(
            f"flowrl.loop(body, ...): body must be a function of the loop's state, got {type(body).__name__}"
        )
    if not isinstance(until, str) or not until:
        raise FlowDefinitionError(f"flowrl.loop(until=...) must name a boolean field, got {until!r}")
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise FlowDefinitionError(f"flowrl.loop(max_turns=...) must be an int >= 1, got {max_turns!r}")
    if deadline_s is not None and (
        isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0
    ):
        raise FlowDefinitionError(f"flowrl.loop(deadline_s=...) must be a positive number or None, got {deadline_s!r}")
    try:
        check_name(name, "flowrl.loop(name=...)")
    except ConfigError:
        raise FlowDefinitionError(f"flowrl.loop(name=...) must be {NAME_RULE}, got {name!r}") from None
    recorder: Any = state._builder
    node: Node = recorder.add_loop(
        body, state, until, max_turns, None if deadline_s is None else float(deadline_s), name
    )
    return node


def flags(value: Any, rows: int) -> list[bool] | None:
    """A column's values as booleans (a list, a numpy array or a tensor); None when it is not
    one value per row of booleans or numbers."""
    if hasattr(value, "tolist") and not isinstance(value, list):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or len(value) != rows:
        return None
    out = []
    for v in value:
        if isinstance(v, (list, tuple)) and len(v) == 1:  # a column of shape (n, 1)
            v = v[0]
        if hasattr(v, "item"):  # a numpy scalar in a list
            v = v.item()
        if not isinstance(v, (bool, int, float)):
            return None
        out.append(bool(v))
    return out


def turn_counts(samples: Iterable[Mapping[str, Any]], loops: Iterable[LoopSpec]) -> dict[str, dict[int, int]]:
    """Per loop: how many of ``samples`` ran how many turns (from their ``<loop>_turns``)."""
    out: dict[str, dict[int, int]] = {}
    for spec in loops:
        counts: dict[int, int] = {}
        for s in samples:
            turns = s.get(spec.turns_field)
            if turns is not None:
                counts[int(turns)] = counts.get(int(turns), 0) + 1
        if counts:
            out[spec.name] = dict(sorted(counts.items()))
    return out
