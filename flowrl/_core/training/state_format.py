"""Checkpoint files: a safe state format and a directory of atomic checkpoints.

State format: msgpack, with numpy arrays and torch tensors as typed extensions (dtype name,
shape, raw bytes). Reading one never runs code from the file (no pickle), and a file is checked
as it is read, since it may be damaged or crafted: a dtype only from an allow-list of numpy's
and torch's plain dtypes, a shape of at most ``MAX_RANK`` non-negative dims whose elements fill
the raw bytes exactly, nesting at most ``MAX_DEPTH`` deep. Every failure is a ``CheckpointError``
naming the file. Memory stays bounded by the file's size: an array is allocated only once its
bytes are known to be in the file, and msgspec refuses a container longer than the bytes left.
Tuples come back as lists.

Directory: ``<root>/episode-000004/`` holds the state after 4 episodes. A checkpoint is
written into a hidden temporary folder, each file flushed to disk, then renamed into place,
so a crash while writing leaves the previous checkpoints whole and a half-written one is
never read.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import shutil
import stat
import struct
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ..errors import CheckpointError

_ARRAY, _TENSOR, _SCALAR = 1, 2, 3
_HEAD = struct.Struct("<I")
_NAME = re.compile(r"^episode-(\d{6,})$")
MAX_DEPTH = 64  # containers in containers: a real state (an optimiser's) is under 10 deep
MAX_RANK = 32  # numpy 1 allows 32 dims: a file with more is not one this format wrote
_MAX_DIM = 2**48  # one dim of a real array is far below; beyond, sizes overflow int64 in torch
_MAX_HEAD = 64 + 12 * MAX_RANK  # bytes of an extension's header: a dtype name and its dims
# numpy dtypes a state may hold (as ``dtype.str``): numbers, bools, dates, fixed-size strings;
# never objects, records or raw voids
_NUMPY_DTYPES = re.compile(r"[<>|=]?(?:b1|[iu][1248]|f[248]|c(?:8|16)|[SU][1-9]\d{0,8}|[Mm]8(?:\[\w{1,12}\])?)")
_TORCH_DTYPES = frozenset(
    "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 complex64 complex128 "
    "float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu".split()
)
_HEAD_DECODER = msgspec.msgpack.Decoder(tuple[str, list[int]])
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
log = logging.getLogger("flowrl")


def _ext(code: int, dtype: str, shape: tuple[int, ...], raw: bytes) -> msgspec.msgpack.Ext:
    head = msgspec.msgpack.encode([dtype, list(shape)])
    return msgspec.msgpack.Ext(code, _HEAD.pack(len(head)) + head + raw)


def _enc(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)):
        kind = obj.dtype
        if kind.hasobject or kind.names:
            raise CheckpointError(f"cannot save a numpy array of dtype {kind} safely (objects or records)")
        if not _NUMPY_DTYPES.fullmatch(kind.str):
            raise CheckpointError(f"cannot save a numpy array of dtype {kind} ({kind.str}) in a checkpoint")
        if isinstance(obj, np.generic):  # kept a numpy scalar: a batch built from it keeps its dtype
            return _ext(_SCALAR, kind.str, (), obj.tobytes())
        return _ext(_ARRAY, kind.str, obj.shape, np.ascontiguousarray(obj).tobytes())
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise CheckpointError(f"cannot save a torch tensor of dtype {obj.dtype} in a checkpoint")
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return _ext(_TENSOR, name, tuple(t.shape), raw)
    raise CheckpointError(
        f"cannot save a {type(obj).__module__}.{type(obj).__qualname__} in a checkpoint; state must be made of "
        "dicts, lists, numbers, strings, None, numpy arrays and torch tensors"
    )


def _header(data: memoryview) -> tuple[str, list[int], memoryview]:
    """An extension's dtype name, shape and raw bytes, the header checked for form and size."""
    if len(data) < _HEAD.size:
        raise CheckpointError(f"an array's header is cut ({len(data)} bytes)")
    (size,) = _HEAD.unpack_from(data)
    if size > min(_MAX_HEAD, len(data) - _HEAD.size):
        raise CheckpointError(f"an array's header claims {size} bytes; at most {_MAX_HEAD} and what follows")
    try:
        dtype, shape = _HEAD_DECODER.decode(data[_HEAD.size : _HEAD.size + size])
    except msgspec.DecodeError as err:
        raise CheckpointError(f"an array's header is not [dtype name, shape] ({err})") from err
    if len(shape) > MAX_RANK:
        raise CheckpointError(f"an array has {len(shape)} dims; at most {MAX_RANK}")
    if any(not 0 <= d <= _MAX_DIM for d in shape):
        raise CheckpointError(f"an array's shape {shape} has a dim outside [0, 2**48]")
    return dtype, shape, data[_HEAD.size + size :]


def _fits(dtype: str, shape: list[int], itemsize: int, raw: memoryview) -> None:
    """Raw bytes that are exactly the elements of ``shape``: never read past them, never
    allocate what the file does not hold."""
    need = math.prod(shape) * itemsize
    if need != len(raw):
        raise CheckpointError(
            f"an array of dtype {dtype} and shape {shape} needs {need} bytes, the file holds {len(raw)}"
        )


def _numpy(code: int, dtype: str, shape: list[int], raw: memoryview) -> Any:
    if not _NUMPY_DTYPES.fullmatch(dtype):
        raise CheckpointError(f"numpy dtype {dtype!r} is not one a checkpoint may hold")
    kind = np.dtype(dtype)
    if code == _SCALAR and shape:
        raise CheckpointError(f"a numpy scalar with shape {shape}")
    _fits(dtype, shape, kind.itemsize, raw)
    # checked on the raw bytes: a 0-dim array cannot be viewed with another itemsize
    if kind.kind == "b" and np.frombuffer(raw, np.uint8).max(initial=0) > 1:
        raise CheckpointError("a numpy bool array holds bytes other than 0 and 1")
    if kind.kind == "U" and np.frombuffer(raw, np.dtype("u4").newbyteorder(kind.byteorder)).max(initial=0) > 0x10FFFF:
        raise CheckpointError("a numpy string array holds a code point past U+10FFFF")
    array = np.frombuffer(raw, dtype=kind).reshape(shape).copy()
    return array[()] if code == _SCALAR else array


def _tensor(dtype: str, shape: list[int], raw: memoryview) -> Any:
    import torch

    kind = getattr(torch, dtype, None) if dtype in _TORCH_DTYPES else None
    if not isinstance(kind, torch.dtype):
        raise CheckpointError(f"torch dtype {dtype!r} is not one a checkpoint may hold")
    _fits(dtype, shape, kind.itemsize, raw)
    if not len(raw):
        return torch.empty(shape, dtype=kind)
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    if kind == torch.bool and int(data.max()) > 1:
        raise CheckpointError("a torch bool tensor holds bytes other than 0 and 1")
    return data.view(kind).reshape(shape)


def _dec(code: int, data: memoryview) -> Any:
    if code not in (_ARRAY, _TENSOR, _SCALAR):
        raise CheckpointError(f"unknown value type {code}")
    dtype, shape, raw = _header(data)
    return _tensor(dtype, shape, raw) if code == _TENSOR else _numpy(code, dtype, shape, raw)


_DECODER = msgspec.msgpack.Decoder(ext_hook=_dec)


def encode_state(state: Any) -> bytes:
    """``state`` (dicts, lists, scalars, strings, arrays, tensors) as bytes."""
    try:
        return msgspec.msgpack.Encoder(enc_hook=_enc).encode(state)
    except OverflowError as err:
        raise CheckpointError(f"cannot save an int outside [-2**63, 2**64 - 1] in a checkpoint ({err})") from err


def decode_state(data: bytes, where: str | None = None) -> Any:
    """The state in ``data``, checked; ``where``: the file's name, for the error."""
    try:
        state = _DECODER.decode(data)
        _check_depth(state)
    except CheckpointError as err:
        raise CheckpointError(_damaged(where, str(err))) from err
    except RecursionError as err:
        raise CheckpointError(_damaged(where, f"nested too deep to read ({err})")) from err
    except Exception as err:  # a crafted file can make any step fail: all of them mean "damaged"
        raise CheckpointError(_damaged(where, f"{type(err).__name__}: {err}")) from err
    return state


def _damaged(where: str | None, why: str) -> str:
    return f"checkpoint file {where} is damaged: {why}" if where else f"a checkpoint file is damaged: {why}"


def _check_depth(state: Any) -> None:
    """No container nested more than ``MAX_DEPTH`` deep (walked without recursion)."""
    stack = [(state, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CheckpointError(f"containers nested more than {MAX_DEPTH} deep")
        if isinstance(node, dict):
            stack.extend((k, depth + 1) for k in node if isinstance(k, tuple))
            node = list(node.values())
        if isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list, tuple)))


def shown(value: Any) -> str:
    """``value`` in an error: its type and length, not its (maybe large, maybe crafted) content."""
    kind = type(value).__name__
    kind = f"an {kind}" if kind[0] in "aeiou" else f"a {kind}"
    try:
        return f"{kind} of length {len(value)}"
    except TypeError:  # no length (a number, a 0-dim array)
        return kind


class CheckpointFolders:
    """The checkpoints under ``root``: write one atomically, find the latest, drop old ones."""

    def __init__(self, root: str | Path, keep: int = 0) -> None:
        self.root = Path(root)
        self.keep = keep
        self._warned: set[str] = set()  # links named like a checkpoint, logged once each

    def episodes(self) -> list[int]:
        """Episodes with a complete checkpoint, oldest first: real folders only. A symbolic link
        named like one is ignored (logged once): resuming from it, or pruning it, would act on
        another folder. No root: none. A root that cannot be listed (a name too long, a NUL in
        it): the OSError or ValueError, for the caller to name the setting."""
        try:
            with os.scandir(self.root) as entries:
                found = [(e.name, e.is_symlink(), e.is_dir(follow_symlinks=False)) for e in entries]
        except (FileNotFoundError, NotADirectoryError):
            return []
        done = []
        for name, link, folder in found:
            m = _NAME.match(name)
            if m and link and name not in self._warned:
                self._warned.add(name)
                log.warning("checkpoint folder %s: %s is a symbolic link, not a checkpoint; ignored", self.root, name)
            if m and folder and not link:
                done.append(int(m.group(1)))
        return sorted(done)

    @staticmethod
    def number(folder: Path) -> int | None:
        """The episode ``folder``'s name says it holds (``episode-000004``: 4); None for another name."""
        m = _NAME.match(folder.name)
        return int(m.group(1)) if m else None

    def path(self, episode: int) -> Path:
        return self.root / f"episode-{episode:06d}"

    def latest(self) -> Path | None:
        done = self.episodes()
        return self.path(done[-1]) if done else None

    def write(self, episode: int, files: dict[str, bytes]) -> Path:
        """Write ``files`` as the checkpoint after ``episode`` episodes; returns its folder. A
        failure (a full disk, no permission) is a CheckpointError naming the path, and leaves the
        checkpoints already written whole."""
        final = self.path(episode)
        for name in files:
            inside(final, name)
        try:
            self._write(final, files)
        except OSError as err:
            path = err.filename or final
            raise CheckpointError(
                f"checkpoint {final}: cannot write {path} ({err.strerror or err}); the checkpoints written before "
                "are left whole"
            ) from err
        self._prune(episode)
        return final

    def _write(self, final: Path, files: dict[str, bytes]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # left by a crash while writing
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for name, data in files.items():
                _put(tmp / name, data)
            _fsync_dir(tmp)
            _swap(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

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
    def read(folder: Path, name: str, limit: int | None = None) -> bytes:
        """File ``name`` of checkpoint ``folder``; ``limit``: the most bytes it may have. Only a
        regular file is read: opened without following a link or waiting on a FIFO or device
        (O_NOFOLLOW | O_NONBLOCK), then checked with fstat on what was opened, and read to its
        size (a file that grows or shrinks meanwhile is refused)."""
        path = inside(folder, name)
        try:
            fd = os.open(path, _READ_FLAGS)
        except OSError as err:
            if err.errno == errno.ELOOP:  # O_NOFOLLOW met a link (one inside the folder: inside() let it by)
                raise CheckpointError(
                    f"checkpoint {folder}: {name} is a symbolic link; expected a regular file"
                ) from err
            raise CheckpointError(f"checkpoint {folder}: cannot read {name} ({err})") from err
        try:
            st = os.fstat(fd)  # what was opened: the path may have been swapped since
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"checkpoint {folder}: {name} is {_kind(st.st_mode)}; expected a regular file")
            if limit is not None and st.st_size > limit:
                raise CheckpointError(
                    f"checkpoint {folder}: {name} has {st.st_size} bytes, more than the {limit} such a file can have"
                )
            f, fd = os.fdopen(fd, "rb"), -1  # closes it from here on
            with f:
                data = f.read(st.st_size + 1)
        except OSError as err:
            raise CheckpointError(f"checkpoint {folder}: cannot read {name} ({err})") from err
        finally:
            if fd >= 0:
                os.close(fd)
        if len(data) != st.st_size:
            raise CheckpointError(
                f"checkpoint {folder}: {name} changed while read ({st.st_size} bytes, then {len(data)}"
                f"{' or more' if len(data) > st.st_size else ''}); expected a file no one writes"
            )
        return data


def _kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")]
    kinds += [(stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"), (stat.S_ISLNK, "a symbolic link")]
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def inside(folder: Path, name: str) -> Path:
    """``folder / name``, once sure it is a file right in ``folder`` (a name from a model's name
    must not lead elsewhere: no separator, not '.' or '..', no link out)."""
    seps = {"/", "\\", os.sep, os.altsep or "/", "\0"}
    path = folder / name
    if not name or name in (".", "..") or any(s in name for s in seps) or path.resolve().parent != folder.resolve():
        raise CheckpointError(
            f"checkpoint {folder}: file name {name!r} would lead out of the checkpoint folder; expected a plain "
            "file name (no path separators, not '.' or '..')"
        )
    return path


def _put(path: Path, data: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        err.filename = err.filename or str(path)  # a failed write() names no file: this one
        raise


def _swap(tmp: Path, final: Path) -> None:
    """``tmp`` renamed to ``final``; a checkpoint already there (the same episode again, a
    rolled-back run) is replaced whole, and put back if the rename fails."""
    old = None
    if final.is_symlink():  # a link named like this checkpoint (episodes() ignores it): not followed
        final.unlink()
    elif final.exists():
        old = final.with_name(f".tmp-old-{uuid.uuid4().hex[:8]}")
        final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:
        if old is not None:
            old.rename(final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
