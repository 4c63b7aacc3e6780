"""Checkpoint files: a safe state format and a directory of atomic checkpoints.

State format: msgpack, with numpy arrays and torch tensors as typed extensions (dtype name,
shape, raw bytes). Reading one never runs code from the file (no pickle), and a dtype name is
only looked up among numpy's and torch's dtypes. Tuples come back as lists.

Directory: ``<root>/episode-000004/`` holds the state after 4 episodes. A checkpoint is
written into a hidden temporary folder, each file flushed to disk, then renamed into place,
so a crash while writing leaves the previous checkpoints whole and a half-written one is
never read.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import struct
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from .errors import CheckpointError

_ARRAY, _TENSOR, _SCALAR = 1, 2, 3
_HEAD = struct.Struct("<I")
_NAME = re.compile(r"^episode-(\d{6,})$")


def _ext(code: int, dtype: str, shape: tuple[int, ...], raw: bytes) -> msgspec.msgpack.Ext:
    head = msgspec.msgpack.encode([dtype, list(shape)])
    return msgspec.msgpack.Ext(code, _HEAD.pack(len(head)) + head + raw)


def _enc(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.dtype.names:
            raise CheckpointError(f"cannot save a numpy array of dtype {obj.dtype} safely (objects or records)")
        return _ext(_ARRAY, obj.dtype.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic):  # kept a numpy scalar: a batch built from it keeps its dtype
        if obj.dtype.hasobject:
            raise CheckpointError(f"cannot save a numpy object scalar ({obj!r}) safely")
        return _ext(_SCALAR, obj.dtype.str, (), obj.tobytes())
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return _ext(_TENSOR, str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
    raise CheckpointError(
        f"cannot save a {type(obj).__module__}.{type(obj).__qualname__} in a checkpoint; state must be made of "
        "dicts, lists, numbers, strings, None, numpy arrays and torch tensors"
    )


def _dec(code: int, data: memoryview) -> Any:
    (size,) = _HEAD.unpack_from(data)
    dtype, shape = msgspec.msgpack.decode(data[_HEAD.size : _HEAD.size + size])
    raw = data[_HEAD.size + size :]
    if code in (_ARRAY, _SCALAR):
        try:
            kind = np.dtype(dtype)
        except TypeError as err:
            raise CheckpointError(f"unknown numpy dtype {dtype!r} in a checkpoint") from err
        if kind.hasobject:
            raise CheckpointError(f"refusing to read a numpy array of dtype {dtype} (Python objects)")
        array = np.frombuffer(raw, dtype=kind).reshape(shape).copy()
        return array[()] if code == _SCALAR else array
    if code == _TENSOR:
        import torch

        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise CheckpointError(f"unknown torch dtype {dtype!r} in a checkpoint")
        if not len(raw):
            return torch.empty(shape, dtype=kind)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind).reshape(shape)
    raise CheckpointError(f"unknown value type {code} in a checkpoint")


def encode_state(state: Any) -> bytes:
    """``state`` (dicts, lists, scalars, strings, arrays, tensors) as bytes."""
    return msgspec.msgpack.Encoder(enc_hook=_enc).encode(state)


def decode_state(data: bytes) -> Any:
    try:
        return msgspec.msgpack.Decoder(ext_hook=_dec).decode(data)
    except (msgspec.DecodeError, ValueError, struct.error) as err:
        raise CheckpointError(f"a checkpoint file is damaged: {err}") from err


def rng_state() -> dict[str, Any]:
    """This process's global random generators: Python's, numpy's, torch's (CPU and CUDA)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(legacy=False)}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(state["numpy"])
    if "torch" in state:
        import torch

        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointDir:
    """The checkpoints under ``root``: write one atomically, find the latest, drop old ones."""

    def __init__(self, root: str | Path, keep: int = 0) -> None:
        self.root = Path(root)
        self.keep = keep

    def episodes(self) -> list[int]:
        """Episodes with a complete checkpoint, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, episode: int) -> Path:
        return self.root / f"episode-{episode:06d}"

    def latest(self) -> Path | None:
        done = self.episodes()
        return self.path(done[-1]) if done else None

    def write(self, episode: int, files: dict[str, bytes]) -> Path:
        """Write ``files`` as the checkpoint after ``episode`` episodes; returns its folder."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # left by a crash while writing
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".tmp-{episode:06d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for name, data in files.items():
                with open(tmp / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            _fsync_dir(tmp)
            final = self.path(episode)
            if final.exists():  # the same episode again (a rolled-back run): replace it whole
                old = self.root / f".tmp-old-{uuid.uuid4().hex[:8]}"
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune(episode)
        return final

    def _prune(self, latest: int) -> None:
        """Drop checkpoints past ``latest`` (a future rolled back, or an older run's), then all but
        the last ``keep``."""
        done = self.episodes()
        for episode in done:
            if episode > latest:
                shutil.rmtree(self.path(episode), ignore_errors=True)
        done = [e for e in done if e <= latest]
        if self.keep > 0:
            for episode in done[: -self.keep]:
                shutil.rmtree(self.path(episode), ignore_errors=True)

    @staticmethod
    def read(folder: Path, name: str) -> bytes:
        try:
            return (folder / name).read_bytes()
        except OSError as err:
            raise CheckpointError(f"checkpoint {folder}: cannot read {name} ({err})") from err


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
