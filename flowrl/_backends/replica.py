"""What runs inside a replica, whatever the backend (shared by both backends).

A replica receives a ``ShardCall``: the shard's sample ids and, per producer, the object
references and rows that hold their fields. It fetches each object once, gathers and merges
the rows (joined by sample id), runs the user's step, checks what came back, and returns a
small ``CallMeta`` plus the new fields as a ``Batch`` that stays in the object store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._core.errors import FlowDefinitionError, FlowError, MissingFieldError, OutputError, StageError
from .._core.flow.batch import Batch, Stream, approx_nbytes
from .._core.flow.columns import column_length, copy_column, like, signature
from .._core.flow.loops import DONE, flags
from .._core.flow.model import Model, step_info, step_target
from .._core.scheduling.overlap import BusyClock
from .._core.settings.config import CallMeta, ShardCall
from .._core.training.staleness import versions_field
from .determinism import use_deterministic_torch
from .weight_arrays import check_weight_hooks, to_tensors, weights_of
from .weight_share import Broadcast, CudaShare, Groups

log = logging.getLogger("flowrl")

Fetch = Callable[[list[Any]], list[Batch]]

LOOP_FIELDS = (
    "; inside flowrl.loop a step reads the loop's state (the fields of the loop's input, as the body "
    "updated them) and the fields earlier steps of the same turn added: a field a step of the body adds "
    "lasts one turn. To carry a value to the next turn, give the input items a starting value for it"
)


def gather(call: ShardCall, fetch: Fetch, private: bool = False) -> Batch:
    """The shard's samples with the fields of every producer it reads, in ``call.ids`` order.

    ``private``: the fetched objects belong to this call alone (unpickled for it), so one
    whose rows are the whole object is used as it is instead of copied."""
    refs: list[Any] = []
    index: dict[Any, int] = {}  # refs hash by object identity (Ray: by object id)
    for piece in call.pieces:
        if piece.ref not in index:
            index[piece.ref] = len(refs)
            refs.append(piece.ref)
    objects = fetch(refs)
    by_producer: dict[str, list[Batch]] = {}
    for piece in call.pieces:
        obj = objects[index[piece.ref]]
        whole = private and len(piece.rows) == len(obj) and piece.rows == list(range(len(obj)))
        part = obj if whole else obj.select(piece.rows)
        by_producer.setdefault(piece.producer, []).append(part if piece.fields is None else part.only(piece.fields))
    merged: Batch | None = None
    for producer, parts in by_producer.items():
        part = parts[0] if len(parts) == 1 else Batch.concat(parts)
        if part.ids.tolist() != call.ids:
            raise FlowError(
                f"internal: rows gathered from {producer!r} are samples {part.ids.tolist()}, expected {call.ids}"
            )
        merged = part if merged is None else merged.merge(part)
    return merged if merged is not None else Batch(call.ids)


def new_fields(
    out: Any, batch: Batch, input_fields: set[str], call: ShardCall, replica: int, writes: Any
) -> dict[str, Any]:
    """The fields a step added, checked: a mapping, one row per sample, no overwrite (but of
    ``call.updates``: a loop's state, which its body updates)."""

    def fail(msg: str) -> OutputError:
        return OutputError(msg, call.stage, replica, call.ids)

    if not isinstance(out, (Mapping, Batch)):
        return_type = type(out).__name__
        raise fail(f"{call.method} must return a mapping of new fields (field -> tensor or list), got {return_type}")
    added: dict[str, Any] = {}
    for name, value in out.items():
        if name in call.updates:
            if column_length(value) == len(batch):  # (a wrong row count is named below)
                try:  # a loop's state keeps the type its input gave it
                    value = like(name, value, batch[name])
                except FlowDefinitionError as err:
                    raise fail(str(err)) from None
        elif name in input_fields:
            if out is batch or value is batch.get(name):
                continue  # passed through untouched (ChatLearn style: ``return data``)
            raise fail(
                f"returned field {name!r}, which its input already has; a stage adds fields, never overwrites one "
                "(inside flowrl.loop, a step may update the fields of the loop's state)"
            )
        rows = column_length(value)
        if rows != len(batch):
            got = f"{rows} rows" if rows is not None else f"a {type(value).__name__}"
            raise fail(f"field {name!r} must have {len(batch)} rows (one per sample of the shard), got {got}")
        added[name] = value
    if writes is not None and set(added) != set(writes):
        raise fail(f"declared writes={sorted(writes)} but returned new fields {sorted(added)}")
    return added


class ReplicaRuntime:
    """One model instance inside one replica."""

    def __init__(self, model: Model, replica_id: int, deterministic: bool = False) -> None:
        self.model = model
        self.replica_id = replica_id
        self.deterministic = deterministic  # torch's deterministic algorithms, from setup() on
        self._steps: dict[str, tuple[Callable[..., Any], Any]] = {}  # method -> (callable, writes)
        self._groups = Groups()  # weight-broadcast groups it joined (weight_transport="nccl")
        # a model that merges shards runs steps at once: each is charged the time no other was
        self._clock = BusyClock() if model.merges_shards else None
        self._clock_lock = threading.Lock()

    def _step(self, method: str) -> tuple[Callable[..., Any], Any]:
        found = self._steps.get(method)
        if found is None:
            found = self._steps[method] = (step_target(self.model, method), step_info(self.model, method).writes)
        return found

    def setup(self, gpu_ids: list[int], node_id: str) -> str:
        m = self.model
        m.replica_id = self.replica_id
        m.gpu_ids = list(gpu_ids)
        m.node_id = node_id
        if self.deterministic:
            use_deterministic_torch()
        try:
            m.setup()
        except Exception as err:
            raise StageError(
                f"setup() failed: {type(err).__name__}: {err}", f"{m.name}.setup", self.replica_id, []
            ) from err
        check_weight_hooks(m, self.replica_id)
        return node_id

    def run(self, call: ShardCall, fetch: Fetch, private: bool = False) -> tuple[CallMeta, Batch]:
        return self.step(call, *self.prepare(call, fetch, private))

    def prepare(self, call: ShardCall, fetch: Fetch, private: bool = False) -> tuple[Batch, float]:
        """The shard's input (``gather``), and the seconds it took; no user code runs here, so
        another thread may prepare the next shard while this replica's step runs."""
        start = time.perf_counter()
        batch = gather(call, fetch, private)
        return batch, time.perf_counter() - start

    def step(self, call: ShardCall, batch: Batch, spent: float = 0.0) -> tuple[CallMeta, Batch]:
        """Run the user's step on a prepared input and check its output; ``spent`` is the
        time the preparation took (counted as the call's busy time)."""
        start, started = time.perf_counter(), time.time()
        inputs = batch.keys()
        turns = None if call.turns is None else dict(zip(call.ids, call.turns, strict=True))
        batch._stream = Stream(call.seed, call.stage, turns)  # each sample's random streams
        parts = micro_batches(batch, self.model.config.batch_size)
        try:
            self.model.begin_shard(batch)
        except Exception as err:
            raise StageError(f"{type(err).__name__}: {err}", call.stage, self.replica_id, call.ids) from err
        added, alone, steps = self._run_parts(call, parts, inputs, time.perf_counter())
        if self.model.track_version:  # a trainer feeds this model: record the weights' version
            version_field = f"{self.model.name}_version"
            if version_field in added:
                raise OutputError(
                    f"field {version_field!r} is reserved for the weight version", call.stage, self.replica_id, call.ids
                )
            if version_field not in inputs:  # a later step of the same model keeps the first's
                added[version_field] = [self.model.weight_version] * len(batch)
        synced = self.model.weight_version if self.model.track_version else -1
        stops = loop_columns(call, batch, added, self.replica_id, (self.model.name, synced)) if call.loop else []
        result = Batch(batch.ids, added, _check=False)
        took = time.perf_counter() - start
        busy = spent + (took if alone is None else alone)
        meta = CallMeta(
            rows=len(batch),
            fields=sorted(added),
            busy_s=busy,
            out_bytes=approx_nbytes(result),
            node_id=self.model.node_id,
            started=started,
            step_s=took,
            types={name: signature(value) for name, value in added.items()},
            stops=stops,
            version=synced,
            steps=steps if len(steps) > 1 else [],
            # the input's gathering too: a shard queued ahead gathers on another thread, but on a
            # busy machine that thread competes with the running step (batch1-scorers, 2 cores:
            # 2.27 s counting it, 2.35 s without, medians of 3)
            shard_s=max(0.0, busy - sum(seconds for _, seconds in steps)),
        )
        return meta, result

    def _run_parts(
        self, call: ShardCall, parts: list[Batch], inputs: set[str], start: float
    ) -> tuple[dict[str, Any], float | None, list[tuple[int, float]]]:
        """The step on each micro-batch of the shard in order, their new fields joined, the
        seconds no overlapping step was charged for (None: none overlapped), and each step's
        samples and seconds."""
        target, writes = self._step(call.method)
        added: list[dict[str, Any]] = []
        alone: float | None = None
        steps: list[tuple[int, float]] = []
        for i, part in enumerate(parts):
            begin = start if i == 0 else time.perf_counter()
            try:
                out, own = self._timed(target, part, call.iteration, begin)
            except Exception as err:
                hint = LOOP_FIELDS if call.in_loop and isinstance(err, MissingFieldError) else ""
                raise StageError(f"{type(err).__name__}: {err}{hint}", call.stage, self.replica_id, call.ids) from err
            steps.append((len(part), time.perf_counter() - begin if own is None else own))
            fields = new_fields(out, part, inputs, call, self.replica_id, writes)
            if i < len(parts) - 1:  # the next step may overwrite a buffer the model reuses
                fields = {name: copy_column(value) for name, value in fields.items()}
            added.append(fields)
            alone = alone if own is None else (alone or 0.0) + own
        if len(parts) == 1:
            return added[0], alone, steps
        try:  # the parts' fields must join: the same kinds, dtypes and trailing shapes
            joined = Batch.concat([Batch(p.ids, a, _check=False) for p, a in zip(parts, added, strict=True)])
        except FlowError as err:
            raise OutputError(f"the shard's micro-batches: {err}", call.stage, self.replica_id, call.ids) from err
        return {name: joined[name] for name in joined}, alone, steps

    def _timed(
        self, target: Callable[..., Any], batch: Batch, iteration: int, start: float
    ) -> tuple[Any, float | None]:
        """The step's output, and where steps overlap (``merges_shards``) the seconds of it that
        no other step was charged for (None: the step ran alone)."""
        if self._clock is None:
            return target(batch, iteration), None
        with self._clock_lock:
            token = self._clock.begin(start)
        try:
            out = target(batch, iteration)
        finally:
            with self._clock_lock:
                alone = self._clock.end(token, time.perf_counter())
        return out, alone

    def get_weights(self) -> dict[str, Any]:
        return weights_of(self.model, self.replica_id)

    def load_weights(self, version: int, weights: Mapping[str, Any] | CudaShare | Broadcast) -> None:
        """New weights from a trainer; runs between shards (the replica runs one call at a time)."""
        where = f"{self.model.name}.set_weights"
        replica = f"replica {self.replica_id} of {self.model.name!r}"
        try:
            if isinstance(weights, CudaShare):
                tensors = weights.open(self.model.device, replica)
            elif isinstance(weights, Broadcast):
                tensors = weights.receive(self.model.device, self._groups, replica)
            else:
                tensors = to_tensors(weights)
            self.model.set_weights(tensors)
        except Exception as err:
            raise StageError(f"{type(err).__name__}: {err}", where, self.replica_id, []) from err
        self.model.weight_version = version


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """A shard in parts of at most ``size`` samples (``ModelConfig.batch_size``: what the model
    takes in one step), in order: a shard of several micro-batches costs one call."""
    if len(batch) <= size:
        return [batch]
    return [batch.select(np.arange(lo, min(lo + size, len(batch)))) for lo in range(0, len(batch), size)]


def loop_columns(call: ShardCall, batch: Batch, added: dict[str, Any], replica: int, own: tuple[str, int]) -> list[str]:
    """The last step of a loop's body returned ``until``: add each sample's turn, why it leaves
    the loop (``done``, ``max_turns``, ``deadline``; "" while it goes on) and, per synced model,
    the weights' version of each of its calls in the loop so far (``<model>_versions``: a
    partial rollout's segments, after those of a loop before this one). ``own``: this step's
    model and version (-1: not synced)."""
    loop = call.loop
    assert loop is not None
    versions = {m: [list(v) for v in per_sample] for m, per_sample in loop.versions.items()}
    for m in dict.fromkeys([*versions, *([own[0]] if own[1] >= 0 else [])]):
        earlier = batch.get(versions_field(m))  # an earlier loop's segments: the state, updated here
        if earlier is not None:
            now = versions.get(m, [[] for _ in call.ids])
            versions[m] = [[int(x) for x in e] + v for e, v in zip(earlier, now, strict=True)]
    if own[1] >= 0:
        for v in versions.setdefault(own[0], [[] for _ in call.ids]):
            v.append(own[1])
    if loop.until not in added:
        raise OutputError(
            f"the last step of a loop's body must return the field flowrl.loop(until={loop.until!r}) names "
            f"(one boolean per sample); it returned {sorted(added)}",
            call.stage,
            replica,
            call.ids,
        )
    done = flags(added[loop.until], len(call.ids))
    if done is None:
        raise OutputError(
            f"field {loop.until!r} (flowrl.loop(until=...)) must hold one boolean per sample, "
            f"got {type(added[loop.until]).__name__}",
            call.stage,
            replica,
            call.ids,
        )
    record: dict[str, Any] = {loop.turns_field: list(loop.turns)}
    record.update({versions_field(m): v for m, v in sorted(versions.items())})
    stops = record[loop.stop_field] = [DONE if d else end for d, end in zip(done, loop.ends, strict=True)]
    for name in record:
        if name in added:
            raise OutputError(f"field {name!r} is reserved for the loop's record", call.stage, replica, call.ids)
    added.update(record)
    return stops
