"""The field-type rule: a field's type, dtype and trailing shape never depend on which samples
share a shard, an input chunk or a trainer's batch (sans-IO; docs/flow-api.md, "Field types")."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flowrl
from flowrl._core.flow.columns import FieldTypes, signature

# ---- input items: one value per item ----

# field class -> draws one item's value (a fixed shape and dtype per field, ragged lists free)
INPUT_VALUES = {
    "int": st.integers(-(2**63), 2**63 - 1),
    "float": st.floats(allow_nan=False),
    "bool": st.booleans(),
    "np-float32": st.floats(-1e6, 1e6, width=32).map(np.float32),
    "np-int8": st.integers(-128, 127).map(np.int8),
    "text": st.one_of(st.text(max_size=4), st.none()),
    "ragged-ids": st.lists(st.integers(0, 9), max_size=4),  # Python lists: a ragged field
    "tensor-3": st.lists(st.floats(-1, 1, width=32), min_size=3, max_size=3).map(torch.tensor),
    "array-2x2": st.lists(st.integers(0, 9), min_size=4, max_size=4).map(lambda v: np.array(v).reshape(2, 2)),
    "tensor-0d": st.integers(0, 99).map(torch.tensor),
}
# what each class becomes as a column: (kind, dtype, trailing shape)
INPUT_COLUMNS = {
    "int": ("array", "int64", ()),
    "float": ("array", "float64", ()),
    "bool": ("array", "bool", ()),
    "np-float32": ("array", "float32", ()),
    "np-int8": ("array", "int8", ()),
    "text": ("list", "", ()),
    "ragged-ids": ("list", "", ()),
    "tensor-3": ("tensor", "float32", (3,)),
    "array-2x2": ("array", "int64", (2, 2)),
    "tensor-0d": ("tensor", "int64", ()),
}


@st.composite
def items_and_cuts(draw: st.DrawFn) -> tuple[list[str], list[dict[str, Any]], list[int]]:
    classes = draw(st.lists(st.sampled_from(sorted(INPUT_VALUES)), min_size=1, max_size=4, unique=True))
    n = draw(st.integers(1, 12))
    items = [{c: draw(INPUT_VALUES[c]) for c in classes} for _ in range(n)]
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    return classes, items, cuts


def _rows(column: Any) -> list[Any]:
    return [r.tolist() if hasattr(r, "tolist") else r for r in column]


@given(items_and_cuts())
def test_input_chunks_concatenate_to_the_batch_of_all_items(case):
    classes, items, cuts = case
    bounds = [0, *cuts, len(items)]
    chunks = [flowrl.Batch.from_items(range(a, b), items[a:b], first_item=a) for a, b in itertools.pairwise(bounds)]
    seen = FieldTypes("the input items")
    for chunk in chunks:
        seen.check(chunk)  # one type per field across chunks: never raises for one class
    whole = flowrl.Batch.from_items(range(len(items)), items)
    joined = flowrl.Batch.concat(chunks)
    for c in classes:
        assert signature(whole[c]) == signature(joined[c]) == INPUT_COLUMNS[c]
        assert _rows(joined[c]) == _rows(whole[c]) == _rows([item[c] for item in items])


# ---- a producer's columns, cut into shards ----

RAGGED_LENGTHS = st.integers(1, 3)  # few lengths: equal lengths within a shard happen often


@st.composite
def outputs_and_shards(draw: st.DrawFn) -> tuple[flowrl.Batch, list[int], list[list[int]]]:
    """A producer's output rows (over several output objects) and consumer shards of them."""
    n = draw(st.integers(1, 10))
    lengths = draw(st.lists(RAGGED_LENGTHS, min_size=n, max_size=n))
    out = flowrl.Batch(
        range(n),
        {
            "logprobs": torch.randn(n, 4),
            "values": np.arange(n * 2, dtype=np.float32).reshape(n, 2),
            "response": [torch.arange(k) for k in lengths],
            "text": [f"r{i}" for i in range(n)],
            "score": torch.rand(n),
        },
    )
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else []
    order = draw(st.permutations(range(n)))
    sizes = draw(st.lists(st.integers(1, n), min_size=1, max_size=n))
    shards, start = [], 0
    for size in sizes:
        if start < n:
            shards.append(sorted(order[start : start + size]))
            start += size
    if start < n:
        shards.append(sorted(order[start:]))
    return out, cuts, shards


@given(outputs_and_shards())
def test_a_shard_gathered_from_several_outputs_has_the_fields_types_of_the_whole(case):
    out, cuts, shards = case
    bounds = [0, *cuts, len(out)]
    objects = [(a, out.select(range(a, b))) for a, b in itertools.pairwise(bounds)]  # the producer's calls
    for shard in shards:
        parts = [obj.select([r - a for r in shard if a <= r < a + len(obj)]) for a, obj in objects]
        gathered = flowrl.Batch.concat([p for p in parts if len(p)], source="policy.forward_step")
        assert gathered.ids.tolist() == shard
        for name, column in out.items():
            assert signature(gathered[name]) == signature(column)
        assert isinstance(gathered["response"], list)  # ragged, even when its rows' lengths match


@given(outputs_and_shards())
def test_samples_rebuild_each_column_as_its_producer_returned_it(case):
    out, _, shards = case
    samples = [flowrl.Sample(int(out.ids[i]), out.row(i), out.kinds()) for i in range(len(out))]
    for shard in shards:
        batch = flowrl.Batch.from_samples(shard, [samples[i] for i in shard])
        for name, column in out.items():
            assert signature(batch[name]) == signature(column)
        assert [r.tolist() for r in batch["response"]] == [out["response"][i].tolist() for i in shard]


# ---- the errors: what they name ----


@pytest.mark.parametrize(
    "left,right,shown",
    [
        (torch.zeros(2, 3), torch.zeros(1, 5), r"float32 tensor of shape \[n, 3\].*float32 tensor of shape \[n, 5\]"),
        (torch.zeros(2), torch.zeros(1, dtype=torch.float64), r"float32 tensor of shape \[n\].*float64 tensor"),
        (torch.zeros(2, 3), [torch.zeros(3)], r"tensor of shape \[n, 3\].*a list of per-sample values"),
        (np.zeros((2, 3)), torch.zeros(1, 3), r"float64 numpy array of shape \[n, 3\].*float32 tensor"),
        (np.zeros(2, dtype=np.int64), np.zeros(1, dtype=np.int32), r"int64 numpy array.*int32 numpy array"),
    ],
    ids=["trailing-shape", "dtype", "tensor-vs-list", "array-vs-tensor", "int-widths"],
)
def test_parts_of_different_types_name_the_field_the_stage_and_the_fix(left, right, shown):
    a = flowrl.Batch([0, 1], {"response": left})
    b = flowrl.Batch([2], {"response": right})
    for parts in ([a, b], [b, a]):
        with pytest.raises(flowrl.FlowDefinitionError) as info:
            flowrl.Batch.concat(parts, source="policy.forward_step")
        msg = str(info.value)
        assert "field 'response' of policy.forward_step" in msg
        assert "a list of per-sample tensors for a ragged field, or pad it to a fixed length" in msg
    with pytest.raises(flowrl.FlowDefinitionError, match=shown):
        flowrl.Batch.concat([a, b])


@pytest.mark.parametrize(
    "values,shown",
    [
        ([1, 2.5], r"an int \(int64\), item 11 holds a float \(float64\)"),
        ([True, 1], r"a bool \(bool\).*an int \(int64\)"),
        ([3, None], r"an int \(int64\), item 11 holds a NoneType"),
        ([np.zeros(2), np.zeros(3)], r"float64 numpy array of shape \[2\].*of shape \[3\].*ids.tolist\(\)"),
        ([torch.zeros(2), np.zeros(2)], r"float32 tensor of shape \[2\].*float64 numpy array"),
        ([np.float32(1), 1.0], r"a float32 \(float32\).*a float \(float64\)"),
    ],
    ids=["int-float", "bool-int", "int-none", "ragged-arrays", "tensor-array", "float-widths"],
)
def test_input_items_that_mix_types_in_a_field_are_refused_naming_both_items(values, shown):
    want = r"field 'answer' of the input items: item 10 holds .*" + shown
    with pytest.raises(flowrl.FlowDefinitionError, match=want):
        flowrl.Batch.from_items([0, 1], [{"answer": v} for v in values], first_item=10)


def test_an_input_int_beyond_int64_is_refused():
    with pytest.raises(flowrl.FlowDefinitionError, match=r"'n' of the input items: .*int64"):
        flowrl.Batch.from_items([0], [{"n": 2**70}])


def test_a_field_that_changes_type_between_chunks_fails_where_it_changes():
    seen = FieldTypes.inputs()
    seen.check(flowrl.Batch.from_items([0, 1], [{"x": 1}, {"x": 2}]))
    seen.check(flowrl.Batch.from_items([2], [{"x": 3}]))
    with pytest.raises(
        flowrl.FlowDefinitionError,
        match=r"'x' of the input items arrives as an int64 numpy array .* float64.*1.0 rather than 1",
    ):
        seen.check(flowrl.Batch.from_items([3], [{"x": 0.5}]))


def test_samples_whose_producers_disagree_are_refused():
    listed = flowrl.Sample(0, {"r": torch.zeros(3)}, {"r": "list"})
    stacked = flowrl.Sample(1, {"r": torch.zeros(3)}, {"r": "tensor"})
    with pytest.raises(flowrl.FlowDefinitionError, match=r"'r' was returned as a list .* as a tensor for others"):
        flowrl.Batch.from_samples([0, 1], [listed, stacked])


def test_rows_of_a_tensor_field_whose_shape_changed_between_shards_are_refused():
    # a stage returned [n, 3] in one shard and [n, 5] in another; no gather joined them
    short = flowrl.Sample(0, {"r": torch.zeros(3)}, {"r": "tensor"})
    long = flowrl.Sample(1, {"r": torch.zeros(5)}, {"r": "tensor"})
    with pytest.raises(flowrl.FlowDefinitionError, match=r"'r' arrives as .*shape \[n, 3\].*shape \[n, 5\]"):
        flowrl.Batch.from_samples([0, 1], [short, long])


def test_a_list_field_of_equal_rows_stays_a_list_and_numbers_become_an_array():
    rows = [{"r": torch.zeros(3), "prompt": i} for i in range(3)]
    samples = [flowrl.Sample(i, r, {"r": "list"}) for i, r in enumerate(rows)]
    batch = flowrl.Batch.from_samples([0, 1, 2], samples)
    assert isinstance(batch["r"], list) and len(batch["r"]) == 3
    assert batch["prompt"].dtype == np.int64 and batch["prompt"].tolist() == [0, 1, 2]
    items = flowrl.Batch.from_items([0, 1], [{"prompt": 3, "text": "a"}, {"prompt": 4, "text": "b"}])
    assert items["prompt"].dtype == np.int64 and items["text"] == ["a", "b"]


def test_a_replicas_report_of_its_fields_types_crosses_the_wire_unchanged():
    from flowrl._core.settings.config import CallMeta, decode_meta, encode_message

    out = flowrl.Batch([0, 1], {"r": [torch.zeros(2), torch.zeros(3)], "lp": torch.zeros(2, 4, dtype=torch.bfloat16)})
    meta = CallMeta(rows=2, fields=["lp", "r"], busy_s=0.0, types={n: signature(v) for n, v in out.items()})
    seen = FieldTypes("")
    assert seen.drift(decode_meta(encode_message(meta)).types) is None
    assert seen.drift(meta.types) is None  # the same, as the in-process backend hands it over
    assert seen.drift({"lp": signature(torch.zeros(1, 4))}) is not None  # bfloat16 -> float32
