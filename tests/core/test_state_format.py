"""Checkpoint state, sans-IO: the safe state format (types, dtypes, refusals, damage) and the
atomic checkpoint folders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flowrl
from flowrl._core.state_format import CheckpointDir, decode_state, encode_state


@pytest.mark.parametrize(
    "value",
    [
        {"a": 1, "b": [1.5, "x", None, True], 3: {"nested": b"raw"}},
        np.arange(12, dtype=np.int16).reshape(3, 4),
        np.zeros((0, 3), dtype=np.float32),
        np.float32(2.5),
        np.int64(-7),
        torch.randn(3, 4).to(torch.bfloat16),
        torch.tensor(3.0),
        torch.empty(0, 2),
        torch.tensor([True, False]),
        torch.arange(6).reshape(2, 3).t(),  # not contiguous
    ],
)
def test_state_round_trips_with_types_and_dtypes(value):
    back = decode_state(encode_state({"v": value}))["v"]
    if isinstance(value, torch.Tensor):
        assert back.dtype == value.dtype and back.shape == value.shape and torch.equal(back, value)
    elif isinstance(value, (np.ndarray, np.generic)):
        assert type(back) is type(value) and back.dtype == value.dtype and np.array_equal(back, value)
    else:
        assert back == value


def test_optimizer_and_rng_state_round_trip_and_load():
    module = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(module.parameters())
    module(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = decode_state(encode_state({"module": module.state_dict(), "optimizer": opt.state_dict()}))
    again = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())
    again.load_state_dict(state["optimizer"])
    assert torch.equal(again.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize(
    "value, message",
    [
        (object(), "cannot save a builtins.object"),
        (np.array([1, "x"], dtype=object), "cannot save a numpy array of dtype object safely"),
        (np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]), "objects or records"),
    ],
)
def test_unsafe_values_are_refused_when_saving(value, message):
    with pytest.raises(flowrl.CheckpointError, match=message):
        encode_state({"v": value})


def test_damaged_file_is_a_checkpoint_error():
    with pytest.raises(flowrl.CheckpointError, match="damaged"):
        decode_state(encode_state({"w": np.arange(100)})[:-10])


def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path):
    store = CheckpointDir(tmp_path, keep=0)
    store.write(1, {"a": b"one"})

    with pytest.raises(TypeError):  # the second file fails after the first was written
        store.write(2, {"a": b"two", "b": 12345})  # type: ignore[dict-item]
    assert store.episodes() == [1] and store.read(store.latest(), "a") == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["episode-000001"]  # nothing half-written left


def test_a_crash_mid_write_is_ignored_then_cleaned_and_old_ones_pruned(tmp_path):
    store = CheckpointDir(tmp_path, keep=2)
    store.write(1, {"a": b"1"})
    crashed = tmp_path / ".tmp-000002-dead"  # what a process killed while writing leaves
    crashed.mkdir()
    (crashed / "a").write_bytes(b"half")
    assert store.latest() == store.path(1)
    store.write(2, {"a": b"2"})
    store.write(3, {"a": b"3"})
    store.write(3, {"a": b"3 again"})  # a rebuilt run writes the same episode again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["episode-000002", "episode-000003"]
    assert store.read(store.latest(), "a") == b"3 again"
    store.write(1, {"a": b"1 again"})  # a run gone back to episode 1: the later ones are another future
    assert store.episodes() == [1] and store.latest() == store.path(1)
