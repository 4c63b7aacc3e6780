"""The ledger: every sample in flight, where its fields live, and the join by sample id.

Per sample, the driver keeps where each producer's fields live (object reference, row), the
stages done, and the node each output was made on. A stage is ready for a sample once all its
inputs are done for it; the last input to finish makes it ready, so a sample is offered to a
stage once. The ledger waits for nothing and calls nothing: the dispatcher tells it what
completed and routes what it answers (samples ready per stage, samples finished).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._core.columns import FieldTypes
from .._core.config import Piece
from .._core.errors import FlowDefinitionError, FlowError, OutputError
from .._core.graph import SOURCE
from .inflight import SampleState

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._backends.specs import ReplicaHandle
    from .._core.config import CallMeta, PipelineConfig
    from .._core.graph import FlowGraph
    from .._core.scheduler import Assignment
    from .inflight import Run


class Ledger:
    """Samples in flight by id, the fields each producer adds, and retries per stage and sample."""

    def __init__(self, graph: FlowGraph, config: PipelineConfig) -> None:
        self._graph = graph
        self._config = config
        self.samples: dict[int, SampleState] = {}
        self.retries: dict[tuple[str, int], int] = {}  # (stage, sample) -> times sent again
        self.fields: dict[str, frozenset[str]] = {}  # producer -> the fields it adds
        self._types: dict[str, FieldTypes] = {}  # stage -> its fields' types, as first returned
        self.next_id = 0

    def renumber(self, next_id: int) -> None:
        self.next_id = next_id
        self.retries.clear()

    def admit(self, run: Run, count: int, ref: Any, costs: list[float] | None) -> list[int]:
        """Number ``count`` new samples, stored as the rows of input object ``ref``."""
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        for row, sid in enumerate(ids):
            self.samples[sid] = SampleState({SOURCE: (ref, row)}, run, costs[row] if costs else 0.0)
        return ids

    def costs(self, ids: list[int]) -> list[float] | None:
        # without estimates every cost is 0 and the stages take the oldest first, as with None
        return [self.samples[sid].cost for sid in ids]

    # ---- what a shard reads, what it returns ----
    def pieces(self, stage: str, ids: list[int], states: Mapping[int, SampleState] | None = None) -> list[Piece]:
        """Where shard ``ids`` of ``stage`` reads its inputs: runs of rows per stored object."""
        states = self.samples if states is None else states
        pieces: list[Piece] = []
        for producer in self._graph.inputs_of(stage):
            if self.fields.get(producer) == frozenset():
                continue  # a producer known to add no fields has nothing to gather
            ref: Any = None
            rows: list[int] = []
            for sid in ids:
                r, row = states[sid].loc[producer]
                if r is not ref and rows:
                    pieces.append(Piece(producer=producer, ref=ref, rows=rows))
                    rows = []
                ref = r
                rows.append(row)
            pieces.append(Piece(producer=producer, ref=ref, rows=rows))
        return pieces

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
            clash = sorted(fields & self.fields.get(other, frozenset()))
            if clash:
                names = ["the flow input" if p == SOURCE else f"stage {p!r}" for p in (other, producer)]
                raise FlowDefinitionError(
                    f"field(s) {clash} are written by both {names[0]} and {names[1]}, and a later stage or "
                    "the flow's output sees both; a field must have one writer — rename one of them"
                )
        if producer == SOURCE:
            self._graph.validate(fields)

    # ---- the join by sample id ----
    def complete(
        self, stage: str, ids: list[int], out_ref: Any, node: str
    ) -> tuple[dict[str, list[int]], list[tuple[int, SampleState]]]:
        """``stage`` made its output for ``ids`` (rows of ``out_ref``): the samples each consumer
        may now take, and the samples that every stage has done (removed from the ledger)."""
        consumers = self._graph.consumers(stage)
        ready: dict[str, list[int]] = {spec.name: [] for spec in consumers}
        finished: list[int] = []
        for row, sid in enumerate(ids):
            state = self.samples[sid]
            if stage in state.done:
                raise FlowError(f"internal: stage {stage!r} processed sample {sid} twice")
            state.done.add(stage)
            state.loc[stage] = (out_ref, row)
            state.node[stage] = node
            for spec in consumers:
                if all(i == SOURCE or i in state.done for i in spec.inputs):
                    ready[spec.name].append(sid)
            if len(state.done) == len(self._graph.stages):
                finished.append(sid)
        return {s: sids for s, sids in ready.items() if sids}, [(sid, self._forget(sid)) for sid in finished]

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
        return sorted(f for p in self._graph.output_producers for f in self.fields.get(p, ()))
