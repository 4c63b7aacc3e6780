"""Sampling a token per row, each row from its own generator (``Batch.generators``).

``torch.multinomial`` over a batch draws every row from one generator, so a row's token
depends on the rows drawn before it, i.e. on which shard it landed in. Drawing each row from
its sample's own stream makes it depend on the sample alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._core.errors import ConfigError
from ._checks import tensor

if TYPE_CHECKING:
    from collections.abc import Sequence


def sample_rows(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One index per row of ``probs`` ``[n, V]`` (non-negative, each row with a positive sum),
    row ``i`` drawn with ``generators[i]`` (on ``probs``' device); returns ``[n]`` (int64)."""
    probs = tensor("sample_rows", "probs", probs, 2)
    if len(generators) != probs.shape[0]:
        raise ConfigError(f"sample_rows: {probs.shape[0]} rows of probs but {len(generators)} generators; one per row")
    rows = [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long, device=probs.device)
