"""Fuzzers (hypothesis) over the checkpoint readers: the state format (``decode_state``) and the
engine's files (``engine.json``, ``relay.msgpack``, through ``CheckpointFormat.load``).

Whatever the bytes (random, valid, or a valid file damaged: bits flipped, cut, spliced,
headers that lie about shapes and dtypes, deep nesting), a read gives the state back or raises
a CheckpointError: never another exception, and never memory a lying header claims. A valid
file reads back equal. The default run is the "ci" profile of tests/conftest.py (fixed seed,
300 cases per test); FLOWRL_FUZZ=long runs 20,000."""

from __future__ import annotations

import math
import struct
import tracemalloc
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import flowrl
from flowrl._core.training.rng_state import rng_state
from flowrl._core.training.state_format import MAX_DEPTH, decode_state, encode_state
from flowrl._engine.checkpoint_files import CheckpointFormat
from flowrl._engine.checkpoint_state import RELAY, STATE, EngineState
from flowrl._engine.engine_stats import EpisodeStats

if TYPE_CHECKING:
    from pathlib import Path

NUMPY_DTYPES = ["|b1", "|i1", "<i2", ">i4", "<i8", "|u1", "<u2", ">u4", "<u8", "<f2", "<f4", ">f8", "<c8", "<c16"]
NUMPY_DTYPES += ["|S3", "<U2", "<M8[s]", "<m8[ms]"]
TORCH_DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"]
TORCH_DTYPES += ["complex64", "uint16", "float8_e5m2"]
shapes = st.lists(st.integers(0, 4), max_size=3)
ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack holds


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    kind, shape = np.dtype(draw(st.sampled_from(NUMPY_DTYPES))), draw(shapes)
    n = math.prod(shape)
    if kind.kind == "U":  # code points a str can hold
        points = draw(st.lists(st.integers(0, 0x10FFFF), min_size=n * 2, max_size=n * 2))
        raw = np.array(points, dtype=kind.byteorder + "u4").tobytes()
    else:
        raw = draw(st.binary(min_size=n * kind.itemsize, max_size=n * kind.itemsize))
        if kind.kind == "b":
            raw = bytes(b & 1 for b in raw)
    array = np.frombuffer(raw, dtype=kind).reshape(shape).copy()
    scalar = not shape and kind.kind not in "SU" and draw(st.booleans())  # an empty str scalar has itemsize 0
    return array[()] if scalar else array  # numpy scalars too


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    kind, shape = getattr(torch, draw(st.sampled_from(TORCH_DTYPES))), draw(shapes)
    raw = draw(st.binary(min_size=math.prod(shape) * kind.itemsize, max_size=math.prod(shape) * kind.itemsize))
    if kind == torch.bool:
        raw = bytes(b & 1 for b in raw)
    if not raw:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind).reshape(shape)


leaves = (
    st.none()
    | st.booleans()
    | ints
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | arrays()
    | tensors()
)
states = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4) | ints, inner, max_size=4),
    max_leaves=12,
)


def same(a: Any, b: Any) -> bool:
    """Equal, arrays and tensors by type, dtype, shape and bytes (NaNs included)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and bytes(a.reshape(-1).view(torch.uint8).numpy()) == bytes(b.reshape(-1).view(torch.uint8).numpy())
        )
    if isinstance(a, (np.ndarray, np.generic)):
        return type(a) is type(b) and (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def read(data: bytes) -> Any:
    """The state in ``data``, or None where it is refused with a CheckpointError (anything else fails the test)."""
    try:
        return decode_state(data, where="fuzzed.msgpack")
    except flowrl.CheckpointError as err:
        assert "fuzzed.msgpack" in str(err)
        return None


# ---- the state format ----
@given(st.binary(max_size=512))
def test_random_bytes_load_or_are_refused(data):
    read(data)


@given(states)
def test_valid_states_round_trip(state):
    assert same(decode_state(encode_state(state)), state)


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    data = bytearray(encode_state(draw(states)))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, max(0, len(data) - 1)))
        how = draw(st.sampled_from(["flip", "cut", "splice", "drop", "repeat"]))
        if how == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif how == "cut":
            del data[at:]
        elif how == "splice":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif how == "drop":
            del data[at : at + draw(st.integers(1, 16))]
        else:
            data[at:at] = data[at : at + draw(st.integers(1, 32))]
    return bytes(data)


@given(damaged())
def test_damaged_valid_files_load_or_are_refused(data):
    read(data)


header_dtypes = st.sampled_from(NUMPY_DTYPES + TORCH_DTYPES + ["|O", "|V4", "qint8", "__class__"]) | st.text(max_size=6)
dims = ints | st.integers(0, 8) | st.sampled_from([2**31, 2**32, 2**40, 2**48, 2**63])


@given(
    st.sampled_from([1, 2, 3]) | st.integers(-128, 127),
    header_dtypes | ints | st.none(),
    st.lists(dims, max_size=40) | ints,
    st.binary(max_size=64),
    st.integers(-8, 8),
)
def test_headers_that_lie_load_only_what_the_file_holds(code, dtype, shape, raw, shift):
    head = msgspec.msgpack.encode([dtype, shape])
    size = max(0, min(len(head) + shift, 2**32 - 1))
    data = msgspec.msgpack.encode([msgspec.msgpack.Ext(code, struct.pack("<I", size) + head + raw)])
    tracemalloc.start()
    try:
        state = read(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20  # nothing of the size a lying header claims
    if state is not None and isinstance(state[0], (np.ndarray, np.generic, torch.Tensor)):
        value = state[0]  # it loaded: exactly the raw bytes, as the shape says
        nbytes = value.nbytes if not isinstance(value, torch.Tensor) else value.numel() * value.element_size()
        assert size == len(head) and nbytes == len(raw) and list(value.shape) == shape


@given(st.integers(1, 3000), st.sampled_from([b"\x91", b"\x81\xa1k", b"\x81\x00"]))
@example(MAX_DEPTH, b"\x91")
@example(MAX_DEPTH + 1, b"\x91")
def test_deep_nesting_is_refused_past_the_bound(depth, opener):
    state = read(opener * depth + b"\xc0")
    assert (state is None) == (depth > MAX_DEPTH)  # MAX_DEPTH containers, the innermost holding None


# ---- the engine's files ----
def engine_state() -> dict[str, Any]:
    """A state an engine writes after 2 episodes of 4 samples (4 prompts each), a trainer of 2
    ranks and one synced model between syncs, as engine.json holds it."""
    stats = [
        EpisodeStats(
            episode=e,
            samples=4,
            rollout_s=0.1,
            train_s=0.2,
            sync_s=0.0,
            eval_s=0.0,
            metrics={"learner": {"loss": 1.0}},
            weight_versions={"policy": e},
        )
        for e in range(2)
    ]
    state = EngineState(
        episode=2, next_sample_id=8, sampler_position=8, dataset_size=10, sample_per_episode=4,
        num_samples_per_prompt=1, shuffle=False, seed=0, weight_versions={"policy": 1}, trainer_ranks={"learner": 2},
        trainer_counts={"learner": {0: [8, 2, 0.5], 1: [8, 2, 0.4]}}, synced=["policy"], episodes=stats,
    )  # fmt: skip
    return msgspec.to_builtins(state)


def relay_state() -> list[dict[str, Any]]:
    return [{"episode": 1, "ids": [4, 5], "fields": [{"x": np.arange(3), "y": "a"}, {"x": np.arange(3), "y": "b"}]}]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[CheckpointFormat, Path]:
    root = tmp_path_factory.mktemp("fuzz")
    # the generators of engine_state's 2 ranks: load() checks there is one per rank
    (root / "learner.rng.msgpack").write_bytes(encode_state([encode_state(rng_state())] * 2))
    config = flowrl.RunConfig(sample_per_episode=4, checkpoint={"dir": str(root / "none")})
    return CheckpointFormat(config), root


def load(files: tuple[CheckpointFormat, Path], state: bytes, relay: bytes) -> Any:
    """The engine's reading of a folder with these engine.json and relay.msgpack, or None where
    it refuses them with a CheckpointError naming one of them."""
    reader, folder = files
    (folder / STATE).write_bytes(state)
    (folder / RELAY).write_bytes(relay)
    try:
        return reader.load(folder, dataset_size=10, trainers=["learner"], targets=["policy"])
    except flowrl.CheckpointError as err:
        assert STATE in str(err) or RELAY in str(err) or "was written with" in str(err) or "holds trainers" in str(err)
        return None


def test_the_valid_engine_files_load(files):
    state, relay = load(files, msgspec.json.encode(engine_state()), encode_state(relay_state()))
    assert state.episode == 2 and [s.id for s in relay[0].buffer] == [4, 5] and relay[0].buffer[1]["y"] == "b"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
state_paths = st.sampled_from(
    [(k,) for k in engine_state()]
    + [("episodes", 0), ("episodes", 1, "episode"), ("episodes", 0, "metrics", "learner")]
    + [("weight_versions", "policy"), ("trainer_ranks", "learner"), ("trainer_counts", "learner", "0")]
    + [("trainer_counts", "learner", "1", 2), ("synced", 0)]
)


def replaced(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``tree`` with the item at ``path`` set to ``value``."""
    node = tree
    for key in path[:-1]:
        node = node[int(key) if isinstance(node, dict) and key not in node else key]
    key = path[-1]
    node[int(key) if isinstance(node, dict) and key not in node and str(key).isdigit() else key] = value
    return tree


@given(state_paths, json_values, st.booleans())
def test_engine_json_with_a_field_replaced_loads_or_is_refused(files, path, value, drop):
    state = engine_state()
    if drop and len(path) == 1:
        del state[path[0]]
    else:
        replaced(state, path, value)
    load(files, msgspec.json.encode(state), encode_state(relay_state()))


@given(st.data())
def test_damaged_engine_json_loads_or_is_refused(files, data):
    raw = bytearray(msgspec.json.encode(engine_state()))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(raw) - 1))
        if data.draw(st.booleans()):
            raw[at] = data.draw(st.integers(0, 255))
        else:
            raw[at:at] = data.draw(st.sampled_from([b"-", b"9" * 30, b"[", b"{", b"null", b"1e400", b'"', b","]))
    load(files, bytes(raw), encode_state(relay_state()))


relay_paths = st.sampled_from(
    [(), (0,), (0, "episode"), (0, "ids"), (0, "ids", 1), (0, "fields"), (0, "fields", 0), (0, "fields", 0, "x")]
)


@given(relay_paths, states, st.booleans())
def test_relay_with_a_part_replaced_loads_or_is_refused(files, path, value, damage):
    relay: Any = relay_state()
    relay = value if not path else replaced(relay, path, value)
    data = encode_state(relay)
    load(files, msgspec.json.encode(engine_state()), data[: len(data) // 2] if damage else data)
