"""Checkpoint state, sans-IO: the safe state format (types, dtypes, refusals, damage) and the
atomic checkpoint folders."""

from __future__ import annotations

import errno
import functools
import os
import stat
import struct
import tracemalloc
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

import flowrl
from flowrl._core.training.rng_state import rng_state, set_rng_state
from flowrl._core.training.state_format import CheckpointFolders, decode_state, encode_state


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
    store = CheckpointFolders(tmp_path, keep=0)
    store.write(1, {"a": b"one"})

    with pytest.raises(TypeError):  # the second file fails after the first was written
        store.write(2, {"a": b"two", "b": 12345})  # type: ignore[dict-item]
    assert store.episodes() == [1] and store.read(store.latest(), "a") == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["episode-000001"]  # nothing half-written left


def test_a_crash_mid_write_is_ignored_then_cleaned_and_old_ones_pruned(tmp_path):
    store = CheckpointFolders(tmp_path, keep=2)
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


# ---- hostile files: every failure is a CheckpointError naming the file ----
def ext(code: int, dtype: object, shape: object, raw: bytes, head_size: int | None = None) -> bytes:
    """An extension as a crafted file would hold it: a header that may lie about the bytes after it."""
    head = msgspec.msgpack.encode([dtype, shape])
    size = len(head) if head_size is None else head_size
    return msgspec.msgpack.encode({"v": msgspec.msgpack.Ext(code, struct.pack("<I", size) + head + raw)})


@pytest.mark.parametrize(
    "data, message",
    [
        (ext(1, "<f8", [3], b"\0" * 16), r"dtype <f8 and shape \[3\] needs 24 bytes, the file holds 16"),
        (ext(2, "float32", [2, 2], b"\0" * 20), r"dtype float32 and shape \[2, 2\] needs 16 bytes, the file holds 20"),
        (ext(1, "<f8", [2**40], b"\0" * 8), r"needs 8796093022208 bytes, the file holds 8"),
        (ext(2, "float32", [2**40], b""), r"needs 4398046511104 bytes, the file holds 0"),
        (ext(3, "<f8", [1], b"\0" * 8), r"a numpy scalar with shape \[1\]"),
        (ext(1, "<f8", [-1], b""), r"shape \[-1\] has a dim outside \[0, 2\*\*48\]"),
        (ext(2, "float32", [0, 2**60], b""), r"has a dim outside"),
        (ext(1, "<f8", [1] * 33, b"\0" * 8), "an array has 33 dims; at most 32"),
        (ext(1, "|O", [1], b"\0" * 8), "numpy dtype '|O' is not one a checkpoint may hold"),
        (ext(1, "|V8", [1], b"\0" * 8), "numpy dtype '|V8' is not one a checkpoint may hold"),
        (ext(1, "<f16", [1], b"\0" * 16), "numpy dtype '<f16' is not one"),
        (ext(2, "__class__", [1], b"\0"), "torch dtype '__class__' is not one"),
        (ext(2, "qint8", [1], b"\0"), "torch dtype 'qint8' is not one"),
        (ext(1, 5, [1], b""), r"header is not \[dtype name, shape\]"),
        (ext(1, "<f8", [1], b"\0" * 8, head_size=2**31), "header claims 2147483648 bytes"),
        (ext(2, "bool", [2], b"\x01\x02"), "bool tensor holds bytes other than 0 and 1"),
        (ext(1, "|b1", [1], b"\x07"), "bool array holds bytes other than 0 and 1"),
        (ext(1, "<U1", [1], b"\xff\xff\xff\xff"), r"code point past U\+10FFFF"),
        (msgspec.msgpack.encode(msgspec.msgpack.Ext(9, b"")), "unknown value type 9"),
        (b"\x91" * 65 + b"\x00", "nested more than 64 deep"),
        (b"\x81\x00" * 65 + b"\x00", "nested more than 64 deep"),
        (b"\x91" * 5000 + b"\x00", "nested"),  # past msgspec's own recursion limit
        (b"\x81\x81\x00\x00\x00", "map keys must be hashable"),
        (b"\xdd\xff\xff\xff\xff\x00", "truncated"),  # a list claiming 2**32 items
        (b"\xc1", "malformed"),
    ],
)
def test_a_crafted_file_is_a_checkpoint_error_naming_it(data, message):
    tracemalloc.start()
    try:
        with pytest.raises(flowrl.CheckpointError, match=message) as caught:
            decode_state(data, where="learner.model.msgpack")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(caught.value).startswith("checkpoint file learner.model.msgpack is damaged: ")
    assert peak < 2**20  # refused before allocating what a lying header claims


def test_nesting_up_to_the_bound_loads():
    assert decode_state(b"\x91" * 63 + b"\x00") == functools.reduce(lambda x, _: [x], range(63), 0)


@pytest.mark.parametrize(
    "value",
    [
        np.array(["a", "dé"]),
        np.array("ab"),  # 0-dim: its code points are checked on the raw bytes
        np.array([b"x", b"yz"]),
        np.array(["2024-01-01"], dtype="datetime64[D]"),
        np.array([1, 2], dtype=">i4"),
        np.array([True, False]),
        torch.arange(3, dtype=torch.int32).to(torch.uint16),
        torch.zeros(2, dtype=torch.float8_e4m3fn),
    ],
)
def test_allowed_dtypes_round_trip(value):
    back = decode_state(encode_state([value]))[0]
    assert type(back) is type(value) and back.dtype == value.dtype and back.shape == value.shape
    if isinstance(value, np.ndarray):
        assert back.tobytes() == value.tobytes()
    else:
        assert torch.equal(back.view(torch.uint8), value.view(torch.uint8))


@pytest.mark.parametrize(
    "value, message",
    [
        (np.zeros(2, dtype="V4"), r"dtype \|V4"),
        (torch.empty(2, dtype=torch.bits8), "torch tensor of dtype torch.bits8"),
    ],
)
def test_what_the_reader_refuses_is_refused_when_saving(value, message):
    with pytest.raises(flowrl.CheckpointError, match=message):
        encode_state(value)


# ---- random generator states ----
def test_rng_state_round_trips_through_a_file_and_restores_the_draws():
    import random

    saved = decode_state(encode_state(rng_state()))
    expected = (random.random(), np.random.random(), torch.rand(1).item())
    set_rng_state(saved)
    assert (random.random(), np.random.random(), torch.rand(1).item()) == expected


def _rng_with(path: tuple[str, ...], value: object) -> dict:
    state = decode_state(encode_state(rng_state()))
    target = state
    for key in path[:-1]:
        target = target[key]
    if isinstance(target, list):
        target[int(path[-1])] = value
    else:
        target[path[-1]] = value
    return state


@pytest.mark.parametrize(
    "state, message",
    [
        ([1, 2], "expected a dict with keys 'python' and 'numpy'"),
        (_rng_with(("python",), [3, [0] * 10, None]), "field 'python': expected .*, got a list of length 3"),
        (_rng_with(("python", "0"), 4), "field 'python'"),
        (_rng_with(("python", "2"), "x"), "field 'python'"),
        (_rng_with(("numpy", "bit_generator"), "PCG64"), "field 'numpy'"),
        (_rng_with(("numpy", "state", "key"), np.zeros(624, dtype=np.int64)), "field 'numpy'"),
        (_rng_with(("numpy", "state", "pos"), 625), "field 'numpy'"),
        (_rng_with(("torch",), torch.zeros(3, dtype=torch.uint8)), "field 'torch': expected a 1-dim uint8 tensor"),
        (_rng_with(("torch",), np.zeros(5056, dtype=np.uint8)), "field 'torch'"),
        (_rng_with(("cuda",), [torch.zeros(2)]), "field 'cuda'"),
    ],
)
def test_a_malformed_rng_state_is_refused_before_any_generator_is_set(state, message):
    import random

    before = random.getstate()
    with pytest.raises(flowrl.CheckpointError, match=f"learner.rng.msgpack rank 1.*{message}"):
        set_rng_state(state, "learner.rng.msgpack rank 1")
    assert random.getstate() == before


# ---- the folder: failed writes and names that lead out ----
def test_a_full_disk_is_a_checkpoint_error_naming_the_file_and_the_old_checkpoint_stays(tmp_path, monkeypatch):
    store = CheckpointFolders(tmp_path, keep=0)
    store.write(1, {"a": b"one"})

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(flowrl.CheckpointError, match=r"episode-000002: cannot write .*/b \(No space left") as caught:
        store.write(2, {"b": b"two"})
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    monkeypatch.undo()
    assert store.episodes() == [1] and store.read(store.latest(), "a") == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["episode-000001"]


def test_rewriting_an_episode_that_fails_keeps_the_one_written_before(tmp_path, monkeypatch):
    store = CheckpointFolders(tmp_path)
    store.write(1, {"a": b"one"})
    real = Path.rename

    def refuse(self: Path, target: Path) -> Path:
        if self.name.startswith(".tmp-episode"):
            raise OSError(errno.EACCES, "Permission denied", str(target))
        return real(self, target)

    monkeypatch.setattr(Path, "rename", refuse)
    with pytest.raises(flowrl.CheckpointError, match=r"cannot write .*episode-000001 \(Permission denied\)"):
        store.write(1, {"a": b"again"})
    monkeypatch.undo()
    assert store.read(store.path(1), "a") == b"one"


@pytest.mark.parametrize("name", ["../evil", "sub/file", "..", ".", "", "a\\b", "nul\0"])
def test_a_file_name_that_leads_out_of_the_checkpoint_is_refused(tmp_path, name):
    store = CheckpointFolders(tmp_path / "ckpt")
    with pytest.raises(flowrl.CheckpointError, match="would lead out of the checkpoint folder"):
        store.write(1, {name: b"x"})
    assert not (tmp_path / "evil").exists() and store.episodes() == []
    (tmp_path / "evil").write_bytes(b"outside")
    with pytest.raises(flowrl.CheckpointError, match="would lead out of the checkpoint folder"):
        CheckpointFolders.read(tmp_path / "ckpt", name)


def test_a_link_out_of_the_checkpoint_is_not_read(tmp_path):
    store = CheckpointFolders(tmp_path / "ckpt")
    folder = store.write(1, {"a": b"x"})
    (tmp_path / "secret").write_bytes(b"outside")
    (folder / "link").symlink_to(tmp_path / "secret")
    with pytest.raises(flowrl.CheckpointError, match="'link' would lead out"):
        CheckpointFolders.read(folder, "link")


def test_a_file_over_its_limit_is_refused_before_reading(tmp_path):
    folder = CheckpointFolders(tmp_path).write(1, {"engine.json": b"{}" * 100})
    with pytest.raises(flowrl.CheckpointError, match="engine.json has 200 bytes, more than the 64"):
        CheckpointFolders.read(folder, "engine.json", limit=64)


# ---- only regular files are read, only real folders are checkpoints ----
def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _device(path: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's: endless bytes
    except PermissionError:
        pytest.skip("making a device node needs root")


def _link_in(path: Path) -> None:
    os.mkfifo(path.parent / "pipe")  # a link that stays inside the folder, to a FIFO
    path.symlink_to(path.parent / "pipe")


@pytest.mark.timeout(30)  # before the fix a FIFO blocked the read forever
@pytest.mark.parametrize(
    "make, message",
    [
        (_fifo, "is a FIFO; expected a regular file"),
        (_device, "is a device; expected a regular file"),
        (lambda p: p.mkdir(), "is a folder; expected a regular file"),
        (_link_in, "is a symbolic link; expected a regular file"),
    ],
)
def test_a_fifo_device_folder_or_link_in_the_checkpoint_is_refused_without_blocking(tmp_path, make, message):
    folder = CheckpointFolders(tmp_path).write(1, {"other": b"x"})
    make(folder / "engine.json")
    with pytest.raises(flowrl.CheckpointError, match=rf"checkpoint {folder}: engine.json {message}"):
        CheckpointFolders.read(folder, "engine.json")
    with pytest.raises(flowrl.CheckpointError, match=rf"checkpoint {folder}: engine.json {message}"):
        CheckpointFolders.read(folder, "engine.json", limit=64)


def test_a_link_to_dev_zero_is_refused(tmp_path):
    folder = CheckpointFolders(tmp_path).write(1, {"other": b"x"})
    (folder / "engine.json").symlink_to("/dev/zero")
    with pytest.raises(flowrl.CheckpointError, match="'engine.json' would lead out"):
        CheckpointFolders.read(folder, "engine.json")


def test_a_file_that_grows_while_read_is_refused(tmp_path, monkeypatch):
    folder = CheckpointFolders(tmp_path).write(1, {"a": b"four"})
    real = os.fstat

    def earlier(fd: int) -> os.stat_result:  # the size fstat saw before a writer appended
        st = real(fd)
        return os.stat_result((st.st_mode, *st[1:6], 2, *st[7:]))

    monkeypatch.setattr(os, "fstat", earlier)
    with pytest.raises(flowrl.CheckpointError, match=r"a changed while read \(2 bytes, then 3 or more\)"):
        CheckpointFolders.read(folder, "a")


def test_a_link_named_like_a_checkpoint_is_neither_resumed_from_nor_pruned(tmp_path, caplog):
    elsewhere = CheckpointFolders(tmp_path / "elsewhere").write(50, {"a": b"outside"})
    store = CheckpointFolders(tmp_path / "ckpt", keep=1)
    store.write(1, {"a": b"one"})
    (tmp_path / "ckpt" / "episode-000050").symlink_to(elsewhere)
    (tmp_path / "ckpt" / "episode-000060").symlink_to(tmp_path / "nowhere")
    with caplog.at_level("WARNING", logger="flowrl"):
        assert store.episodes() == [1] and store.latest() == store.path(1)
        assert store.episodes() == [1]
    assert sum("episode-000050 is a symbolic link" in r.message for r in caplog.records) == 1
    store.write(2, {"a": b"two"})  # prunes episode 1, never touches the links
    assert store.episodes() == [2] and (elsewhere / "a").read_bytes() == b"outside"
    assert (tmp_path / "ckpt" / "episode-000050").is_symlink()
    store.write(50, {"a": b"fifty"})  # writing that episode replaces the link, not what it points to
    assert store.read(store.path(50), "a") == b"fifty" and (elsewhere / "a").read_bytes() == b"outside"
    assert not (tmp_path / "ckpt" / "episode-000050").is_symlink()


@pytest.mark.parametrize(
    "path, message",
    [
        (("python", "1"), "field 'python': expected a valid Mersenne Twister state"),
        (("numpy", "state", "key"), "field 'numpy': expected a valid MT19937 key"),
    ],
)
def test_an_all_zero_mersenne_twister_state_is_refused(path, message):
    import random

    state = decode_state(encode_state(rng_state()))
    if path[0] == "python":
        state["python"][1] = [0] * 624 + [624]
    else:
        state["numpy"]["state"]["key"] = np.zeros(624, dtype=np.uint32)
    before = random.getstate()
    with pytest.raises(flowrl.CheckpointError, match=message):
        set_rng_state(state, "learner.rng.msgpack rank 0")
    assert random.getstate() == before
    if path[0] == "python":
        state["python"][1][0] = 0x80000000  # only the top bit of the first word: a valid state
    else:
        state["numpy"]["state"]["key"][5] = 1
    set_rng_state(state)
    random.setstate(before)
