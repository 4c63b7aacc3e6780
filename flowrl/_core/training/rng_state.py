"""A process's random generators as checkpoint state: read them, check a state read back
from a file (it may be damaged or crafted) and set them from it."""

from __future__ import annotations

import random
import sys
from typing import Any

import numpy as np

from ..errors import CheckpointError
from .state_format import shown


def rng_state() -> dict[str, Any]:
    """This process's global random generators: Python's, numpy's, torch's (CPU and CUDA)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(legacy=False)}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Any, where: str = "the random generator state") -> None:
    """Set the generators ``rng_state`` gave, once ``state`` is checked to be such a state."""
    check_rng_state(state, where)
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(state["numpy"])
        if "torch" in state:
            import torch

            torch.set_rng_state(state["torch"])
            if "cuda" in state and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["cuda"])
    except (ValueError, TypeError, RuntimeError, OverflowError, IndexError) as err:
        raise CheckpointError(f"{where}: the generators refused it ({type(err).__name__}: {err})") from err


def check_rng_state(state: Any, where: str = "the random generator state") -> None:
    """``state`` has the form ``rng_state`` gives, or a CheckpointError names the part that has not."""
    if not isinstance(state, dict) or "python" not in state or "numpy" not in state:
        _bad_rng(where, "", "a dict with keys 'python' and 'numpy' (and 'torch', 'cuda')", state)
    py = state["python"]
    if not (
        isinstance(py, list | tuple)
        and len(py) == 3
        and type(py[0]) is int
        and py[0] == 3
        and isinstance(py[1], list | tuple)
        and len(py[1]) == 625
        and all(type(x) is int and 0 <= x < 2**32 for x in py[1])
        and py[1][-1] <= 624
        and (py[2] is None or type(py[2]) is float)
    ):
        _bad_rng(where, "python", "[3, 624 words and an index <= 624 (ints < 2**32), None or a float]", py)
    if _degenerate(py[1][0], any(py[1][1:624])):
        _bad_rng(where, "python", f"a valid Mersenne Twister state ({_ZERO})", py)
    _check_numpy_rng(state["numpy"], where)
    if "torch" in state:
        import torch

        length = torch.get_rng_state().numel()
        if not _bytes_tensor(state["torch"]) or state["torch"].numel() != length:
            _bad_rng(where, "torch", f"a 1-dim uint8 tensor of {length} bytes", state["torch"])
    cuda = state.get("cuda", [])
    if not isinstance(cuda, list) or not all(_bytes_tensor(t) for t in cuda):
        _bad_rng(where, "cuda", "a list of 1-dim uint8 tensors (one per device)", cuda)


def _check_numpy_rng(np_state: Any, where: str) -> None:
    inner = np_state.get("state") if isinstance(np_state, dict) else None
    key, pos = (inner.get("key"), inner.get("pos")) if isinstance(inner, dict) else (None, None)
    if not (
        isinstance(np_state, dict)
        and np_state.get("bit_generator") == "MT19937"
        and isinstance(key, np.ndarray)
        and key.dtype == np.uint32
        and key.shape == (624,)
        and type(pos) is int
        and 0 <= pos <= 624
        and np_state.get("has_gauss") in (0, 1)
        and type(np_state.get("gauss")) is float
    ):
        want = "{bit_generator: 'MT19937', state: {key: 624 uint32, pos: 0..624}, has_gauss: 0 or 1, gauss: float}"
        _bad_rng(where, "numpy", want, np_state)
    assert isinstance(key, np.ndarray)
    if _degenerate(int(key[0]), bool(key[1:].any())):
        _bad_rng(where, "numpy", f"a valid MT19937 key ({_ZERO})", np_state)


_ZERO = "not all zero: the top bit of the first word or any other word set"


def _degenerate(first: int, rest: bool) -> bool:
    """A Mersenne Twister state that only the top bit of its first word and the other 623
    words make up, all zero: the generator's one invalid state (it would draw zeros forever)."""
    return not first & 0x80000000 and not rest


def _bytes_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


def _bad_rng(where: str, part: str, want: str, given: Any) -> None:
    field = f" field {part!r}" if part else ""
    raise CheckpointError(f"{where}{field}: expected {want}, got {shown(given)}")
