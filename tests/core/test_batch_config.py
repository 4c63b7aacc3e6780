"""Batch and the configuration Structs (sans-IO; the replica's output check is in
backends/test_output_check.py)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import flowrl
from flowrl._core.settings.config import to_config

# ---- Batch ----


@pytest.mark.parametrize(
    "value,rows",
    [
        ([1, 2], 2),
        (np.zeros((2, 3)), 2),
        (torch.zeros(2), 2),
        ((1, 2, 4), 3),
        (np.zeros(5), 5),
        (torch.zeros(()), None),
        (7, None),
        ("abc", None),
    ],
    ids=["list2", "np2", "torch2", "tuple3", "np5", "scalar-tensor", "int", "str"],
)
def test_construction_checks_one_row_per_sample(value, rows):
    ids = [10, 11, 12]
    if rows == len(ids):
        assert len(flowrl.Batch(ids, {"f": value})) == 3
    else:
        with pytest.raises(flowrl.FlowError, match="'f'.*3 rows"):
            flowrl.Batch(ids, {"f": value})


def test_construction_accepts_matching_columns():
    b = flowrl.Batch(np.array([[4], [5]]), {"t": torch.ones(2, 3), "a": np.ones((2,)), "l": ["x", "y"]})
    assert b.ids.tolist() == [4, 5] and len(b) == 2 and b.keys() == {"t", "a", "l"} and "zz" not in b


def test_from_samples_stacks_tensors_and_arrays():
    samples = [{"t": torch.full((3,), float(i)), "a": np.full((2, 2), i), "s": f"p{i}"} for i in range(4)]
    b = flowrl.Batch.from_samples([7, 8, 9, 10], samples)
    assert isinstance(b["t"], torch.Tensor) and tuple(b["t"].shape) == (4, 3)
    assert isinstance(b["a"], np.ndarray) and b["a"].shape == (4, 2, 2)
    assert b["s"] == ["p0", "p1", "p2", "p3"]
    for i in range(4):
        assert torch.equal(b["t"][i], samples[i]["t"])
        assert np.array_equal(b["a"][i], samples[i]["a"])


@pytest.mark.parametrize(
    "values",
    [
        [torch.zeros(2), torch.zeros(3)],
        [np.zeros(2), np.zeros(3)],
        [torch.zeros(2), np.zeros(2)],
        [np.zeros(2), [0.0, 0.0]],
    ],
    ids=["ragged-torch", "ragged-numpy", "mixed-kinds", "array-and-list"],
)
def test_from_samples_falls_back_to_lists(values):
    b = flowrl.Batch.from_samples(list(range(len(values))), [{"v": v} for v in values])
    assert isinstance(b["v"], list)
    assert all(got is want for got, want in zip(b["v"], values, strict=True))


def test_from_samples_rejects_mismatches():
    with pytest.raises(flowrl.FlowError, match="2 ids for 1 samples"):
        flowrl.Batch.from_samples([0, 1], [{"q": 1}])
    with pytest.raises(flowrl.FlowError, match="same fields"):
        flowrl.Batch.from_samples([0, 1], [{"q": 1}, {"p": 1}])


def _columns(ids):
    n = len(ids)
    return flowrl.Batch(
        ids,
        {
            "t": torch.arange(n * 2).reshape(n, 2) + 100 * ids[0],
            "a": np.arange(n) + 100 * ids[0],
            "l": [f"s{i}" for i in ids],
        },
    )


@pytest.mark.parametrize("rows", [[0], [2, 0], [3, 1, 2], [], [1, 1]])
def test_select_takes_rows_in_order(rows):
    b = _columns([5, 6, 7, 8])
    sel = b.select(rows)
    assert sel.ids.tolist() == [b.ids[r] for r in rows]
    assert sel["l"] == [b["l"][r] for r in rows]
    assert sel["a"].tolist() == [b["a"][r] for r in rows]
    assert sel["t"].tolist() == [b["t"][r].tolist() for r in rows]


def test_concat_stacks_uniform_columns():
    parts = [_columns([0, 1]), _columns([2]), _columns([3, 4, 5])]
    out = flowrl.Batch.concat(parts)
    assert out.ids.tolist() == list(range(6))
    assert isinstance(out["t"], torch.Tensor) and torch.equal(out["t"], torch.cat([p["t"] for p in parts]))
    assert isinstance(out["a"], np.ndarray) and out["a"].tolist() == [x for p in parts for x in p["a"].tolist()]
    assert out["l"] == [f"s{i}" for i in range(6)]
    assert len(flowrl.Batch.concat([])) == 0


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_concat_refuses_tensors_of_different_trailing_shapes(kind):
    make = torch.ones if kind == "torch" else np.ones
    a = flowrl.Batch([0, 1], {"r": make((2, 3))})
    b = flowrl.Batch([2], {"r": make((1, 5))})
    with pytest.raises(flowrl.FlowDefinitionError, match=r"'r' of policy.forward_step.*\[n, 3\].*\[n, 5\].*ragged"):
        flowrl.Batch.concat([a, b], source="policy.forward_step")


def test_concat_keeps_a_list_field_a_list_even_when_its_rows_match():
    a = flowrl.Batch([0, 1], {"r": [torch.ones(3), torch.ones(3)]})
    b = flowrl.Batch([2], {"r": [torch.ones(3)]})
    out = flowrl.Batch.concat([a, b])
    assert isinstance(out["r"], list) and [tuple(r.shape) for r in out["r"]] == [(3,)] * 3


def test_concat_rejects_different_fields():
    with pytest.raises(flowrl.FlowError, match="concatenate"):
        flowrl.Batch.concat([flowrl.Batch([0], {"x": [1]}), flowrl.Batch([1], {"y": [1]})])


def test_merge_unites_fields_of_the_same_samples():
    left = flowrl.Batch([3, 4], {"x": [1, 2]})
    right = flowrl.Batch([3, 4], {"y": torch.tensor([5, 6])})
    out = left.merge(right)
    assert out.keys() == {"x", "y"} and out.ids.tolist() == [3, 4]
    assert out["x"] == [1, 2] and out["y"].tolist() == [5, 6]
    with pytest.raises(flowrl.FlowError, match="different samples"):
        left.merge(flowrl.Batch([4, 3], {"y": [0, 0]}))
    with pytest.raises(flowrl.FlowError, match="'x'"):
        left.merge(flowrl.Batch([3, 4], {"x": [0, 0]}))


def test_setitem_adds_but_never_overwrites():
    b = flowrl.Batch([0, 1], {"x": [1, 2]})
    b["y"] = torch.zeros(2)
    assert "y" in b
    with pytest.raises(flowrl.FlowError, match="'x' already exists"):
        b["x"] = [3, 4]
    assert b["x"] == [1, 2]
    with pytest.raises(flowrl.FlowError, match="2 rows"):
        b["z"] = [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
def test_pickle_round_trip_keeps_values_ids_and_tensors(dtype):
    t = (torch.arange(6).reshape(3, 2) % 2).to(dtype)
    b = flowrl.Batch([9, 4, 7], {"t": t, "a": np.arange(3.0), "l": ["a", None, {"k": 1}]})
    back = pickle.loads(pickle.dumps(b))
    assert back.ids.tolist() == [9, 4, 7]
    assert isinstance(back["t"], torch.Tensor) and back["t"].dtype == dtype and torch.equal(back["t"], t)
    assert isinstance(back["a"], np.ndarray) and back["a"].tolist() == [0.0, 1.0, 2.0]
    assert back["l"] == ["a", None, {"k": 1}]


@pytest.mark.parametrize(
    "column",
    [
        np.arange(6, dtype=np.int32).reshape(3, 2),
        np.array([True, False, True]),
        np.array(["ab", "c", ""]),
        np.array(["2026-11-29", "2026-11-30", "2027-01-01"], dtype="datetime64[D]"),
        np.arange(12.0).reshape(3, 4)[:, ::2],  # not contiguous
        np.arange(12.0).reshape(4, 3).T,  # Fortran order
        np.zeros(3, dtype=[("a", "i4"), ("b", "f8")]),  # structured: numpy's own pickling
        np.array([{"k": 1}, None, "x"], dtype=object),  # objects: numpy's own pickling
        np.ones((3, 4096)),  # over SMALL_ARRAY: numpy's own pickling (out-of-band buffers)
        torch.arange(3, dtype=torch.int16),
    ],
    ids=["int32-2d", "bool", "unicode", "datetime", "strided", "fortran", "structured", "object", "big", "torch"],
)
def test_small_arrays_pickle_as_raw_bytes_and_come_back_equal_and_writable(column):
    back = pickle.loads(pickle.dumps(flowrl.Batch([5, 6, 7], {"c": column}), protocol=5))
    assert back.ids.tolist() == [5, 6, 7] and back.ids.dtype == np.int64
    value = back["c"]
    assert type(value) is type(column) and value.dtype == column.dtype and tuple(value.shape) == tuple(column.shape)
    if isinstance(column, torch.Tensor):
        assert torch.equal(value, column)
    else:
        assert np.array_equal(value, column) if column.dtype != object else value.tolist() == column.tolist()
        assert value.flags.writeable  # as a pickled array comes back


def test_pickle_round_trip_of_a_conjugated_complex_tensor():
    t = torch.tensor([1 + 2j, 3 - 1j]).conj()
    back = pickle.loads(pickle.dumps(flowrl.Batch([0, 1], {"c": t})))
    assert torch.equal(back["c"], t.resolve_conj())


def test_missing_field_keyerror_lists_fields():
    b = flowrl.Batch([0], {"query": [1], "response": [2]})
    with pytest.raises(KeyError) as info:
        b["reward"]
    msg = str(info.value)
    assert "reward" in msg and "query" in msg and "response" in msg


# ---- ModelConfig / PipelineConfig ----


@pytest.mark.parametrize("num_gpu,tp,pp", [(8, 4, 1), (8, 1, 1), (16, 2, 4), (6, 3, 2)])
def test_replicas_derived_from_gpus(num_gpu, tp, pp):
    c = flowrl.ModelConfig(num_gpu=num_gpu, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert c.replicas == num_gpu // (tp * pp)
    assert c.replica_gpus == float(tp * pp)
    assert c.replicas * c.replica_gpus == num_gpu


def test_issue_policy_config():
    c = flowrl.ModelConfig(num_gpu=8, tensor_parallel_size=4)
    assert (c.replicas, c.replica_gpus) == (2, 4.0)
    assert flowrl.ModelConfig(num_gpu=8, tensor_parallel_size=4, num_replicas=2).replicas == 2


@pytest.mark.parametrize("num_gpu,tp,pp", [(6, 4, 1), (1, 2, 1), (12, 1, 8), (30, 4, 1)])
def test_num_gpu_not_a_multiple_names_valid_values(num_gpu, tp, pp):
    per = tp * pp
    with pytest.raises(flowrl.ConfigError) as info:
        flowrl.ModelConfig(num_gpu=num_gpu, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    msg = str(info.value)
    assert f"num_gpu={num_gpu}" in msg and f"multiple of {per}" in msg
    suggested = [int(x) for x in msg.split("e.g. num_gpu=")[1].split(" or ")]
    assert suggested and all(x % per == 0 and x > 0 for x in suggested)
    assert all(abs(x - num_gpu) < per for x in suggested)  # the nearest valid counts


@pytest.mark.parametrize("num_replicas", [1, 3, 8])
def test_num_replicas_disagreeing_with_num_gpu(num_replicas):
    with pytest.raises(flowrl.ConfigError, match="num_replicas"):
        flowrl.ModelConfig(num_gpu=8, tensor_parallel_size=4, num_replicas=num_replicas)


@pytest.mark.parametrize("bad", [0, -1])
@pytest.mark.parametrize(
    "cls,key",
    [
        (flowrl.ModelConfig, k)
        for k in ("num_replicas", "num_gpu", "tensor_parallel_size", "pipeline_parallel_size", "batch_size", "prefetch")
    ]
    + [(flowrl.PipelineConfig, k) for k in ("max_inflight", "input_chunk", "setup_timeout_s", "ray_init_cpus")],
)
def test_non_positive_sizes_name_the_key(cls, key, bad):
    with pytest.raises(flowrl.ConfigError, match=key):
        cls(**{key: bad})
    with pytest.raises(flowrl.ConfigError, match=key):
        to_config(cls, {key: bad}, "somewhere")


@pytest.mark.parametrize("key", ["cpus_per_replica", "gpus_per_replica"])
def test_negative_resources_rejected(key):
    with pytest.raises(flowrl.ConfigError, match=key):
        flowrl.ModelConfig(**{key: -0.5})
    assert getattr(flowrl.ModelConfig(**{key: 0.0}), key) == 0.0


@pytest.mark.parametrize("value", [{"batchsize": 2}, {"batch_size": "two"}, {"splitter": "fastest"}, 3])
def test_to_config_rejects_unknown_keys_and_wrong_types(value):
    with pytest.raises(flowrl.ConfigError) as info:
        to_config(flowrl.ModelConfig, value, "model 'ref' config")
    assert "model 'ref' config" in str(info.value)
    if isinstance(value, dict):
        assert next(iter(value)) in str(info.value)


def test_defaults_and_to_config_passthrough():
    c = flowrl.ModelConfig()
    assert (c.replicas, c.replica_gpus, c.batch_size) == (1, 0.0, 1)
    assert c.splitter in flowrl.SPLITTERS
    assert c.prefetch >= 2  # the design's credit of two per replica
    p = flowrl.PipelineConfig()
    assert p.backend == "ray" and p.max_inflight > 0 and p.input_chunk > 0
    assert flowrl.ModelConfig(num_replicas=3, gpus_per_replica=0.5).replica_gpus == 0.5
    assert to_config(flowrl.ModelConfig, None, "w") == c
    assert to_config(flowrl.ModelConfig, {"batch_size": 4}, "w").batch_size == 4
    given = flowrl.ModelConfig(num_replicas=3)
    assert to_config(flowrl.ModelConfig, given, "w") is given


def test_unknown_splitter_in_struct_is_a_config_error():
    with pytest.raises(flowrl.ConfigError, match="fastest"):
        flowrl.ModelConfig(splitter="fastest")


@pytest.mark.parametrize("column", [np.arange(3.0), torch.arange(3.0), [[1], [2], [3]]], ids=["numpy", "torch", "list"])
def test_a_copied_batch_keeps_its_rows_when_the_original_columns_change(column) -> None:
    b = flowrl.Batch([0, 1, 2], {"c": column})
    kept = b.copy()
    if isinstance(column, list):
        column[0] = ["changed"]
    else:
        column[0] = 99
    assert kept.ids.tolist() == [0, 1, 2] and kept["c"][0] != column[0] and len(kept) == 3
