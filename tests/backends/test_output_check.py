"""The replica's check of what a step returns (sans-IO): rows, types, overwritten and declared
fields."""

from __future__ import annotations

import pytest
import torch

import flowrl
from flowrl._backends.replica import new_fields
from flowrl._core.settings.config import ShardCall

IDS = [40, 41, 42]


def _call():
    return ShardCall(stage="reward.forward_step", method="forward_step", iteration=0, ids=list(IDS), pieces=[])


def _input():
    return flowrl.Batch(IDS, {"query": torch.zeros(3, 2), "response": ["a", "b", "c"]})


def _check(out, batch, writes=None):
    return new_fields(out, batch, batch.keys(), _call(), 5, writes)


def _fails(out, batch, *needles, writes=None):
    with pytest.raises(flowrl.OutputError) as info:
        _check(out, batch, writes)
    err = info.value
    assert (err.stage, err.replica, err.sample_ids) == ("reward.forward_step", 5, IDS)
    msg = str(err)
    for needle in ("reward.forward_step", "replica 5", str(IDS), *needles):
        assert needle in msg, (needle, msg)


@pytest.mark.parametrize("rows", [0, 2, 4])
def test_wrong_length_is_an_output_error(rows):
    _fails({"score": torch.zeros(rows)}, _input(), "'score'", f"{rows} rows")


def test_non_column_value_is_an_output_error():
    _fails({"score": 1.5}, _input(), "'score'", "float")


def test_overwrite_of_an_input_field_is_an_output_error():
    _fails({"response": ["x", "y", "z"]}, _input(), "'response'", "overwrite")


@pytest.mark.parametrize("out", [[1, 2, 3], torch.zeros(3), None, "scores"])
def test_non_mapping_return_is_an_output_error(out):
    _fails(out, _input(), type(out).__name__)


def test_pass_through_of_the_same_batch_keeps_only_new_fields():
    batch = _input()
    batch["score"] = torch.ones(3)
    added = new_fields(batch, batch, {"query", "response"}, _call(), 5, None)
    assert set(added) == {"score"} and torch.equal(added["score"], torch.ones(3))


def test_pass_through_of_input_columns_in_a_dict():
    batch = _input()
    added = _check({"query": batch["query"], "score": [1, 2, 3]}, batch)
    assert added == {"score": [1, 2, 3]}


def test_declared_writes_must_match():
    assert set(_check({"score": [1, 2, 3]}, _input(), writes={"score"})) == {"score"}
    _fails({"score": [1, 2, 3]}, _input(), "score", "values", writes={"score", "values"})
