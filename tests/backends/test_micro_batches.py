"""A shard of more samples than the model's ``batch_size`` runs in one call as several
micro-batches: the step sees at most ``batch_size`` samples at a time, in order, and the
call's fields are theirs joined."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from flowrl import Batch, Model
from flowrl._backends.replica import ReplicaRuntime, micro_batches
from flowrl._core.errors import OutputError, StageError
from flowrl._core.settings.config import ShardCall


class Seen(Model):
    """Records each call's shard and each step's ids and each sample's seed; returns a list, a
    tensor and an array."""

    def setup(self) -> None:
        self.steps: list[list[int]] = []
        self.shards: list[list[int]] = []
        self.seeds: dict[int, int] = {}

    def begin_shard(self, batch: Batch) -> None:
        self.shards.append(batch.ids.tolist())
        if self.config.batch_size == 5:  # a call whose fixed cost the replica measures apart
            time.sleep(0.05)

    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        ids = batch.ids.tolist()
        self.steps.append(ids)
        self.seeds.update(zip(ids, batch.seeds().tolist(), strict=True))
        if self.config.batch_size == 3 and len(batch) == 1:  # a last part of another kind
            return {"s": np.array(["odd"]), "t": torch.zeros(1, 2), "a": np.zeros((1, 3))}
        return {
            "s": [f"x{x}" for x in batch["x"]],
            "t": torch.stack([torch.tensor([x, 2 * x]) for x in batch["x"]]).float(),
            "a": np.repeat(np.asarray(batch["x"], dtype=float)[:, None], 3, axis=1),
        }


def call_of(ids: list[int]) -> ShardCall:
    return ShardCall(stage="seen.forward_step", method="forward_step", iteration=0, ids=ids, pieces=[], seed=7)


def run(batch_size: int, ids: list[int]) -> tuple[Seen, Any, Batch]:
    model = Seen("seen", {"batch_size": batch_size})
    runtime = ReplicaRuntime(model, 0)
    runtime.setup([], "node")
    meta, out = runtime.step(call_of(ids), Batch(ids, {"x": [float(i) for i in ids]}))
    return model, meta, out


@pytest.mark.parametrize(("size", "n", "parts"), [(2, 5, [2, 2, 1]), (4, 4, [4]), (1, 3, [1, 1, 1]), (8, 3, [3])])
def test_a_shard_is_cut_into_micro_batches_of_the_models_batch_size(size: int, n: int, parts: list[int]) -> None:
    assert [len(p) for p in micro_batches(Batch(list(range(n)), {"x": list(range(n))}), size)] == parts


def test_a_shard_of_several_micro_batches_runs_them_in_order_in_one_call_and_joins_their_fields() -> None:
    ids = [11, 4, 9, 2, 7]
    model, meta, out = run(2, ids)
    assert model.steps == [[11, 4], [9, 2], [7]]
    assert meta.rows == 5 and out.ids.tolist() == ids
    assert out["s"] == [f"x{float(i)}" for i in ids]
    assert torch.equal(out["t"], torch.tensor([[i, 2 * i] for i in ids]).float())
    assert out["a"].shape == (5, 3) and out["a"][:, 0].tolist() == [float(i) for i in ids]
    # each sample's random stream is its own, whatever micro-batch it lands in
    alone, _, _ = run(8, ids)
    assert model.seeds == alone.seeds and alone.steps == [ids]


def test_micro_batches_whose_fields_do_not_join_fail_the_call_naming_the_stage() -> None:
    with pytest.raises(OutputError, match=r"seen.forward_step.*micro-batches.*'s'"):
        run(3, [1, 2, 3, 4])


def test_begin_shard_runs_once_a_call_with_the_whole_shard_and_its_time_is_reported_apart() -> None:
    model, meta, _ = run(5, [3, 1, 4, 11, 5, 9, 2])
    assert model.shards == [[3, 1, 4, 11, 5, 9, 2]] and model.steps == [[3, 1, 4, 11, 5], [9, 2]]
    assert [n for n, _ in meta.steps] == [5, 2]
    # the call's time beyond its steps holds the 50 ms of begin_shard (counted in a step, it
    # would be missing there; no bound on the steps' own time, which a busy machine stretches)
    assert meta.shard_s >= 0.05
    assert meta.busy_s >= meta.shard_s + sum(seconds for _, seconds in meta.steps) - 1e-9


def test_a_failing_begin_shard_fails_the_call_naming_the_stage_and_samples() -> None:
    class Broken(Seen):
        def begin_shard(self, batch: Batch) -> None:
            raise RuntimeError("no scorer")

    runtime = ReplicaRuntime(Broken("seen", {"batch_size": 2}), 0)
    runtime.setup([], "node")
    with pytest.raises(StageError, match=r"seen.forward_step.*RuntimeError: no scorer") as info:
        runtime.step(call_of([1, 2, 3]), Batch([1, 2, 3], {"x": [1.0, 2.0, 3.0]}))
    assert info.value.sample_ids == [1, 2, 3]


class Reuses(Model):
    """Returns rows of one buffer that every step overwrites, as a model reusing its output
    buffer would: each micro-batch's rows must be kept as that step returned them."""

    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        if not hasattr(self, "buffer"):
            self.buffer = np.zeros((8, 2))
            self.tensor = torch.zeros(8, 2)
        self.buffer[: len(batch)] = batch.ids[:, None]
        self.tensor[: len(batch)] = torch.as_tensor(batch.ids)[:, None].float()
        return {"a": self.buffer[: len(batch)], "t": self.tensor[: len(batch)]}


@pytest.mark.parametrize("batch_size", [1, 2])
def test_each_micro_batch_keeps_what_its_step_returned_when_the_model_reuses_its_buffer(batch_size: int) -> None:
    runtime = ReplicaRuntime(Reuses("reuses", {"batch_size": batch_size}), 0)
    runtime.setup([], "node")
    ids = [3, 4, 5, 6, 7]
    _, out = runtime.step(call_of(ids), Batch(ids, {"x": [0.0] * len(ids)}))
    assert out["a"][:, 0].tolist() == ids
    assert out["t"][:, 0].tolist() == ids
