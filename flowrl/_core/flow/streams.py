"""Per-sample random streams: the same draws for a sample whatever replica, shard and timing.

A replica's own generator makes a sample's draws depend on which replica ran it and on what
ran there before; shard boundaries depend on timing. A stream keyed by what identifies the
sample's work instead, (run seed, stage, sample id, turn of its loop), gives the sample the
same draws on any layout, in process and on Ray alike. The key is hashed with blake2b (stable
across processes and Python versions, unlike ``hash``) into a 64-bit seed per row.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence


def row_seeds(seed: int, stage: str, ids: Sequence[int] | np.ndarray, turns: Sequence[int] | None = None) -> np.ndarray:
    """One 64-bit seed per sample of ``ids`` (uint64), from the run's ``seed``, the ``stage``
    and each sample's ``turns`` entry (its turn of the stage's loop; 0 outside loops)."""
    prefix = hashlib.blake2b(f"{seed}\0{stage}".encode(), digest_size=16).digest()
    turns = [0] * len(ids) if turns is None else turns
    out = np.empty(len(ids), dtype=np.uint64)
    for row, (sid, turn) in enumerate(zip(ids, turns, strict=True)):
        digest = hashlib.blake2b(prefix + struct.pack("<qq", int(sid), int(turn)), digest_size=8).digest()
        out[row] = int.from_bytes(digest, "little")
    return out


def derived_seed(seed: int, purpose: str) -> int:
    """A seed of its own for ``purpose`` (e.g. an evaluation pipeline beside the rollout's)."""
    digest = hashlib.blake2b(f"{seed}\0{purpose}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # within the configs' integer range, [0, 2**62)


def numpy_generators(seeds: np.ndarray) -> list[np.random.Generator]:
    return [np.random.default_rng(int(s)) for s in seeds]


def torch_generators(seeds: np.ndarray, device: Any = None) -> list[Any]:
    """A ``torch.Generator`` per row, on ``device`` (CPU by default), seeded from ``seeds``."""
    import torch  # lazily: the core does not need torch to be installed

    # manual_seed takes [-2**63, 2**64): a uint64 fits as it is
    return [torch.Generator(device if device is not None else "cpu").manual_seed(int(s)) for s in seeds]
