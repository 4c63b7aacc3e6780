"""``Healing``: how a pool replaces a replica that dies, so that it keeps its size."""

from __future__ import annotations

import msgspec

from ..checks import non_negative, positive, struct_types
from ..errors import ConfigError
from .base import Settings


class Healing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """Replace a replica that dies (its process exits, its node is lost, or it fails while
    loading weights) with a new one, started as an elastic grow starts one: set up, handed the
    pool's current weights, and only then given shards.

    ``max_restarts``: how many replacements in a row one replica may have (its replacement's
    replacement counts as the second); a replacement that completes a shard ends the row. A
    replica past it is left out, and the pool runs smaller (reported as a ``left out`` scale
    event and a warning). ``per_minute``: the most replacements a pool starts within any 60 s.
    ``backoff_s``: the wait before a replica's second replacement in a row, doubled for each
    further one, up to ``max_backoff_s`` (the first starts at once).
    """

    max_restarts: int = 3
    per_minute: int = 10
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        struct_types(self)
        positive("Healing", per_minute=self.per_minute)
        non_negative(
            "Healing", max_restarts=self.max_restarts, backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s
        )
        if self.max_backoff_s < self.backoff_s:
            raise ConfigError(f"Healing.max_backoff_s={self.max_backoff_s} is below backoff_s={self.backoff_s}")
