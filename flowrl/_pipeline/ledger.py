"""The ledger: every sample in flight, where its fields live, and the join by sample id.

Per sample, the driver keeps where each producer's fields live (object reference, row), the
stages done, and the node each output was made on. A stage is ready for a sample once all its
inputs are done for it; the last input to finish makes it ready, so a sample is offered to a
stage once. The ledger waits for nothing and calls nothing: the dispatcher tells it what
completed and routes what it answers (samples ready per stage, samples finished).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._core.errors import FlowDefinitionError, FlowError, OutputError
from .._core.flow.columns import FieldTypes
from .._core.flow.graph import SOURCE
from .._core.flow.loops import DEADLINE, MAX_TURNS
from .._core.settings.config import LoopCall, Piece, ShardCall
from .._core.training.staleness import versions_field
from .carry import Carry
from .inflight import SampleState

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._backends.specs import ReplicaHandle
    from .._core.flow.graph import FlowGraph, StageSpec
    from .._core.flow.loops import LoopSpec
    from .._core.scheduling.scheduler import Assignment
    from .._core.settings.config import CallMeta, PipelineConfig
    from .inflight import Loc, Run, Turns


@dataclass
class Completed:
    """What a finished shard unlocks: samples each stage may take now, samples that start
    another turn of a loop (per loop), and samples every stage has done."""

    ready: dict[str, list[int]] = field(default_factory=dict)
    again: dict[str, list[int]] = field(default_factory=dict)
    finished: list[tuple[int, SampleState]] = field(default_factory=list)
    left: list[tuple[str, int, str]] = field(default_factory=list)  # (loop, turns, why): samples that left one
    dropped: list[tuple[int, SampleState]] = field(default_factory=list)  # dropped, and no call of theirs left


class Ledger:
    """Samples in flight by id, the fields each producer adds, and retries per stage and sample."""

    def __init__(self, graph: FlowGraph, config: PipelineConfig) -> None:
        self._graph = graph
        self._config = config
        self.samples: dict[int, SampleState] = {}
        self.retries: dict[tuple[str, int], int] = {}  # (stage, sample) -> times sent again
        self.fields: dict[str, frozenset[str]] = {}  # producer -> the fields it adds
        self._types: dict[str, FieldTypes] = {}  # stage -> its fields' types, as first returned
        self._carry = Carry(graph, self.fields)  # where a loop's updated fields are read
        self.next_id = 0

    def renumber(self, next_id: int) -> None:
        self.next_id = next_id
        self.retries.clear()

    def admit(self, run: Run, ids: list[int], ref: Any, costs: list[float] | None) -> None:
        """Samples ``ids`` are new, stored as the rows of input object ``ref``."""
        self.next_id = max(self.next_id, max(ids) + 1)  # a later run is numbered after every id used
        if run.ids is not None and any(sid in self.samples for sid in ids):
            taken = [sid for sid in ids if sid in self.samples][:3]
            raise FlowDefinitionError(
                f"AsyncPipeline.run(ids=...): samples {taken} are still in flight in this pipeline"
            )
        for row, sid in enumerate(ids):
            state = self.samples[sid] = SampleState({SOURCE: (ref, row)}, run, costs[row] if costs else 0.0)
            for spec in self._graph.loops_from.get(SOURCE, ()):
                state.turns(spec.name)

    def costs(self, ids: list[int]) -> list[float] | None:
        # without estimates every cost is 0 and the stages take the oldest first, as with None
        return [self.samples[sid].cost for sid in ids]

    # ---- what a shard reads, what it returns ----
    def pieces(self, stage: str, ids: list[int], states: Mapping[int, SampleState] | None = None) -> list[Piece]:
        """Where shard ``ids`` of ``stage`` reads its inputs: runs of rows per stored object."""
        states = self.samples if states is None else states
        pieces: list[Piece] = []
        needs = self._carry.needs(stage) if self._graph.loops else set()
        for producer in self._graph.inputs_of(stage):
            fields = self.fields.get(producer)
            if fields == frozenset():
                continue  # a producer known to add no fields has nothing to gather
            keep = None
            if needs and fields is not None and fields & needs:
                keep = sorted(fields - needs)  # updated by a loop: read from the writer chosen below
                if not keep:
                    continue
            _runs(pieces, producer, [states[sid].loc[producer] for sid in ids], keep)
        for name in sorted(needs):
            source = self._carry.source(stage, name)
            if source is not None:
                locs = [states[sid].loc[source] for sid in ids]
            else:
                locs = [self._turn_start(states[sid], stage, name) for sid in ids]
            _runs(pieces, f"~{name}", locs, [name])
        return pieces

    def _turn_start(self, state: SampleState, stage: str, name: str) -> Loc:
        """Where state field ``name`` was as the sample's current turn of ``stage``'s loop began."""
        spec = self._graph.loop_of[stage]
        found = state.turns(spec.name).start.get(name)
        return found if found is not None else state.loc[self._carry.before(spec, name)]

    def shard_call(self, stage: str, method: str, iteration: int, ids: list[int]) -> ShardCall:
        """What a replica is sent to run ``ids`` on ``stage``."""
        return ShardCall(
            stage=stage,
            method=method,
            iteration=iteration,
            ids=ids,
            pieces=self.pieces(stage, ids),
            updates=self.updates(stage),
            in_loop=stage in self._graph.loop_of,
            loop=self.loop_call(stage, ids),
            seed=self._config.seed or 0,
            turns=self.turns_of(stage, ids),
        )

    def _segments(self, spec: LoopSpec, turns: list[Turns]) -> dict[str, list[list[int]]]:
        """Per synced model, the versions of its calls in this loop so far, per sample. When the
        loop's state already holds ``<model>_versions`` (a loop before it wrote them), the last
        step reads the list as this turn began and adds this turn's calls: only those are sent."""
        state = self._carry.state(spec)
        models = {m for t in turns for m in t.versions}
        return {
            m: [(t.turn_versions if versions_field(m) in state else t.versions).get(m, []) for t in turns]
            for m in models
        }

    def turns_of(self, stage: str, ids: list[int]) -> list[int] | None:
        """Inside a loop: each sample's turn (None for a stage outside loops)."""
        spec = self._graph.loop_of.get(stage)
        return None if spec is None else [self.samples[sid].turns(spec.name).turn for sid in ids]

    def updates(self, stage: str) -> list[str]:
        """The fields ``stage`` may return although its input has them: the state of its loop."""
        spec = self._graph.loop_of.get(stage)
        if spec is None:
            return []
        return sorted(self._carry.state(spec))

    def loop_call(self, stage: str, ids: list[int]) -> LoopCall | None:
        """For the last stage of a loop's body: each sample's turn, and why it ends after it."""
        spec = self._graph.loop_ended_by.get(stage)
        if spec is None:
            return None
        now = time.monotonic()
        turns = [self.samples[sid].turns(spec.name) for sid in ids]
        ends = [
            MAX_TURNS
            if t.turn >= spec.max_turns
            else DEADLINE
            if spec.deadline_s is not None and now - t.entered >= spec.deadline_s
            else ""
            for t in turns
        ]
        return LoopCall(
            until=spec.until,
            turns_field=spec.turns_field,
            stop_field=spec.stop_field,
            turns=[t.turn for t in turns],
            ends=ends,
            versions=self._segments(spec, turns),
        )

    def check_output(self, a: Assignment, handle: ReplicaHandle, meta: CallMeta) -> None:
        fields = frozenset(meta.fields)
        if meta.rows != len(a.ids):
            raise OutputError(f"returned {meta.rows} rows for {len(a.ids)} samples", a.stage, handle.replica_id, a.ids)
        known = self.fields.get(a.stage)
        if known is not None and known != fields:
            raise OutputError(
                f"returned fields {sorted(fields)}, but its earlier shards returned {sorted(known)}; "
                "every shard of a stage must add the same fields",
                a.stage,
                handle.replica_id,
                a.ids,
            )
        self.note_fields(a.stage, fields)
        drift = self._types.setdefault(a.stage, FieldTypes("")).drift(meta.types)
        if drift is not None:  # found where it is produced, whichever shards a consumer gathers
            raise OutputError(drift, a.stage, handle.replica_id, a.ids)

    def note_fields(self, producer: str, fields: frozenset[str]) -> None:
        """The fields ``producer`` adds; two writers of one field that a reader sees both fail."""
        known = self.fields.get(producer)
        if known is not None:
            if producer == SOURCE and known != fields:
                raise FlowDefinitionError(
                    f"input items have fields {sorted(fields)}, earlier items had {sorted(known)}"
                )
            return
        self.fields[producer] = fields
        for other in self._graph.cohabitants(producer):
            clash = sorted(fields & self.fields.get(other, frozenset()) - self._updated(producer, other))
            if clash:
                names = ["the flow input" if p == SOURCE else f"stage {p!r}" for p in (other, producer)]
                raise FlowDefinitionError(
                    f"field(s) {clash} are written by both {names[0]} and {names[1]}, and a later stage or "
                    "the flow's output sees both; a field must have one writer — rename one of them"
                )
        if producer == SOURCE:
            self._graph.validate(fields)

    def _updated(self, a: str, b: str) -> frozenset[str]:
        """The fields ``a`` and ``b`` may both write: ``spec``'s state, which its body updates
        (two body stages only one after the other: each turn's order must be fixed)."""
        spec = self._graph.updates(a, b)
        if spec is None:
            return frozenset()
        body = [p for p in (a, b) if p in spec.body]
        if (
            len(body) == 2
            and body[0] not in self._graph.visible(body[1])
            and body[1] not in self._graph.visible(body[0])
        ):
            return frozenset()  # side by side in a turn: which update is the last would be a race
        return frozenset(self._carry.state(spec))

    # ---- the join by sample id ----
    def complete(
        self, stage: str, ids: list[int], out_ref: Any, node: str, stops: list[str] | None = None, version: int = -1
    ) -> Completed:
        """``stage`` made its output for ``ids`` (rows of ``out_ref``): the samples each consumer
        may now take, those that start another turn of a loop, and those that every stage has
        done (removed from the ledger). ``stops``: for a loop's last stage, why each sample
        leaves the loop ("" for one that goes on); ``version``: the weights' version of a synced
        model's step (-1: not synced)."""
        graph = self._graph
        body_of, ends, entered = graph.loop_of.get(stage), graph.loop_ended_by.get(stage), graph.loops_from.get(stage)
        model = graph.stages[stage].model
        out = Completed()
        for row, sid in enumerate(ids):
            state = self.samples[sid]
            if stage in state.done:
                raise FlowError(f"internal: stage {stage!r} processed sample {sid} twice")
            state.done.add(stage)
            if state.dropped:  # a call that was under way when the sample was dropped: nothing follows
                state.waiting.discard(stage)
                if not state.waiting:
                    out.dropped.append((sid, self._forget(sid)))
                continue
            state.loc[stage] = (out_ref, row)
            state.node[stage] = node
            for loop in entered or ():
                state.turns(loop.name)
            if body_of is not None and version >= 0:  # a synced model's call: a segment's version
                turns = state.turns(body_of.name)
                turns.versions.setdefault(model, []).append(version)
                turns.turn_versions.setdefault(model, []).append(version)
            consumers = graph.consumers(stage)
            if ends is not None:
                consumers = self._end_turn(ends, sid, state, (stops or [])[row], out)
            for spec in consumers:
                if all(i == SOURCE or i in state.done for i in spec.inputs):
                    out.ready.setdefault(spec.name, []).append(sid)
            if len(state.done) == graph.visits:
                out.finished.append((sid, self._forget(sid)))
        return out

    def _end_turn(self, spec: LoopSpec, sid: int, state: SampleState, stop: str, out: Completed) -> list[StageSpec]:
        """A sample's turn of ``spec`` ended: it leaves the loop (its exit is done) or starts the
        next turn (the body's stages are undone); the stages that may take it now."""
        turns = state.turns(spec.name)
        turns.turn_versions = {}
        if stop:
            state.done.add(spec.exit)
            out.left.append((spec.name, turns.turn, stop))
            for after in self._graph.loops_from.get(spec.exit, ()):  # a loop right after this one
                state.turns(after.name)
            return self._graph.consumers(spec.exit)
        for name in self._carry.updated(spec):  # what the next turn starts from
            writer = self._carry.last(spec, name)
            if writer is not None:
                turns.start[name] = state.loc[writer]
        if self.retries:  # a turn's retries are its own
            for stage in spec.body:
                self.retries.pop((stage, sid), None)
        state.done.difference_update(spec.body)
        turns.turn += 1
        out.again.setdefault(spec.name, []).append(sid)
        return self._graph.turn_starts(spec)

    def _pending(self, state: SampleState, but: str = "") -> list[str]:
        """The stages (other than ``but``) that ``state`` is queued for or running on: their inputs are done."""
        return [
            name
            for name, spec in self._graph.stages.items()
            if name != but and name not in state.done and all(i == SOURCE or i in state.done for i in spec.inputs)
        ]

    def drop(self, stage: str, ids: list[int]) -> tuple[list[int], list[str], list[tuple[int, SampleState]]]:
        """Samples ``ids`` failed on ``stage`` for good: those dropped now (not on another
        branch before), the stages that expected them and will now never see them (once per
        sample), and the samples with no call left (now out of the ledger). One still queued or
        running elsewhere (a parallel branch) leaves once that call ends, its output unused."""
        fresh: list[int] = []
        unseen: list[str] = []
        gone: list[tuple[int, SampleState]] = []
        for sid in ids:
            state = self.samples[sid]
            if state.dropped:  # dropped on another branch already: this call was one it waited for
                state.waiting.discard(stage)
            else:
                fresh.append(sid)
                state.dropped = stage
                state.waiting = set(self._pending(state, but=stage))
                unseen += [
                    n for n in self._graph.stages if n != stage and n not in state.done and n not in state.waiting
                ]
            if not state.waiting:
                gone.append((sid, self._forget(sid)))
        return fresh, unseen, gone

    def _forget(self, sid: int) -> SampleState:
        if self.retries:  # its retry counts go too: ids are reused after a resume
            for stage in self._graph.stages:
                self.retries.pop((stage, sid), None)
        return self.samples.pop(sid)

    # ---- retries ----
    def retried(self, stage: str, ids: list[int]) -> None:
        for sid in ids:
            self.retries[(stage, sid)] = self.retries.get((stage, sid), 0) + 1

    @property
    def max_retries(self) -> int:
        return self._config.max_retries

    def spent(self, stage: str, ids: list[int]) -> list[int]:
        """The samples of ``ids`` already sent again ``PipelineConfig.max_retries`` times on ``stage``."""
        return [sid for sid in ids if self.retries.get((stage, sid), 0) >= self._config.max_retries]

    # ---- the flow's output ----
    def output_producers(self, fields: frozenset[str] | None) -> tuple[str, ...]:
        """The producers whose fields a run returns (all of the output's when ``fields`` is None)."""
        producers = self._graph.output_producers
        if fields is None:
            return producers
        return tuple(p for p in producers if self.fields.get(p, frozenset()) & fields)

    def output_fields(self) -> list[str]:
        return sorted({f for p in self._graph.output_producers for f in self.fields.get(p, ())})


def _runs(pieces: list[Piece], producer: str, locs: list[Loc], fields: list[str] | None) -> None:
    """``locs`` (one per sample, in shard order) as pieces: one per run of rows in one object."""
    ref: Any = None
    rows: list[int] = []
    for r, row in locs:
        if r is not ref and rows:
            pieces.append(Piece(producer=producer, ref=ref, rows=rows, fields=fields))
            rows = []
        ref = r
        rows.append(row)
    pieces.append(Piece(producer=producer, ref=ref, rows=rows, fields=fields))
