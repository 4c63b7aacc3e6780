"""The records of what is in flight: a sample's state, and a run's."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._core.flow.batch import Sample

Loc = tuple[Any, int]  # (object reference, row)


class Turns:
    """A sample inside a loop: its turn (from 1), when it entered, and where each state field
    its body updates was when the turn began (from turn 2 on)."""

    __slots__ = ("entered", "start", "turn", "turn_versions", "versions")

    def __init__(self) -> None:
        self.turn = 1
        self.entered = time.monotonic()
        self.start: dict[str, Loc] = {}  # state field -> its value as this turn began
        self.versions: dict[str, list[int]] = {}  # synced model -> its weights' version at each call here
        self.turn_versions: dict[str, list[int]] = {}  # the same, this turn's calls only


class SampleState:
    __slots__ = ("cost", "done", "dropped", "loc", "loops", "node", "run", "waiting")

    def __init__(self, loc: dict[str, Loc], run: Run, cost: float) -> None:
        self.loc = loc
        self.node: dict[str, str] = {}  # stage -> the node its output was made on
        self.done: set[str] = set()  # stages done (this turn's, inside a loop) and loops left
        self.run = run
        self.cost = cost  # its estimate (PipelineConfig.cost_field), else 0
        self.loops: dict[str, Turns] | None = None  # per loop it entered (None: none)
        self.dropped = ""  # the stage that dropped it (its retries spent); its other calls still end
        self.waiting: set[str] = set()  # dropped: the stages whose calls of it are still to end

    def turns(self, loop: str) -> Turns:
        if self.loops is None:
            self.loops = {}
        found = self.loops.get(loop)
        if found is None:
            found = self.loops[loop] = Turns()
        return found


class Run:
    def __init__(self, index: int, first_id: int, ordered: bool, limit: int, fields: frozenset[str] | None) -> None:
        self.index = index
        self.first_id = first_id
        self.ids: list[int] | None = None  # the samples' ids when the caller chose them (``run(ids=...)``)
        self.ordered = ordered
        self.fields = fields  # None: every field of the flow's output
        self.costs: list[float] | None = None  # an estimate per item (``stream(costs=...)``)
        self.admitted = 0
        self.finished = 0
        self.admission_done = False
        self.abandoned = False
        self.send, self.recv = anyio.create_memory_object_stream[tuple[int, dict[str, Loc] | None]](limit)
        self.drained = anyio.Event()
        # finished, waiting for their turn: where the fields are, the sample read already, or
        # None for a dropped sample
        self.held: dict[int, dict[str, Loc] | Sample | None] = {}
        self.states: dict[int, SampleState] = {}  # finished samples not yet delivered: their whole state
        self.started = time.perf_counter()
        self.active_closed = False
        self.stop_admission: Callable[[], None] = lambda: None

    def id_at(self, position: int) -> int:
        """The id of the run's ``position``-th item."""
        return self.first_id + position if self.ids is None else self.ids[position]

    def maybe_close(self) -> None:
        if self.admission_done and self.finished == self.admitted:
            self.send.close()
            self.drained.set()
