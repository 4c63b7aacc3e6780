"""Whether a pool replaces a replica that died, and after how long (sans-IO: times are given).

Replica ids are never reused, so a replica and the replicas started in its place form a line:
the line's row counts its replacements since its last replica completed a shard. The policy
(``Healing``) bounds the row, the pool's replacements per minute, and spaces a line's
replacements out (exponential backoff), so that a replica that keeps dying on start is left
out instead of restarted for ever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..settings.healing import Healing

WINDOW_S = 60.0  # Healing.per_minute counts the replacements started within this


@dataclass(frozen=True)
class Restart:
    """The answer for one death: wait ``delay_s`` then start a replacement, or none (None)."""

    delay_s: float | None
    reason: str


class RestartPolicy:
    """One pool's replacements of replicas that died."""

    def __init__(self, model: str, config: Healing | None) -> None:
        self.model, self.config = model, config
        self._row: dict[int, int] = {}  # replica -> replacements in a row of its line before it
        self._started: deque[float] = deque()  # when the pool's recent replacements were decided

    def died(self, replica: int, now: float) -> Restart:
        """Replica ``replica`` died at ``now`` (seconds): replace it, and when."""
        c, row = self.config, self._row.get(replica, 0)
        if c is None:
            return Restart(None, f"replica {replica} of {self.model!r} died; ModelConfig.healing is off")
        if row >= c.max_restarts:
            return Restart(
                None,
                f"replica {replica} of {self.model!r} died after {row} replacements in a row "
                f"(Healing.max_restarts={c.max_restarts}): left out",
            )
        while self._started and self._started[0] <= now - WINDOW_S:
            self._started.popleft()
        if len(self._started) >= c.per_minute:
            return Restart(
                None,
                f"replica {replica} of {self.model!r} died; {len(self._started)} replacements in the last "
                f"{WINDOW_S:g} s already (Healing.per_minute={c.per_minute}): left out",
            )
        self._started.append(now)
        delay = 0.0 if row == 0 else min(c.backoff_s * 2 ** (row - 1), c.max_backoff_s)
        return Restart(delay, f"replaced replica {replica}, which died ({row + 1} in a row)")

    def start_failed(self, replica: int, now: float) -> Restart:
        """The replacement of ``replica`` failed to start (its setup or its weights): an attempt
        of its line like one that died, so the same bounds and backoff decide whether to try again."""
        self._row[replica] = self._row.get(replica, 0) + 1
        return self.died(replica, now)

    def replaced(self, old: int, new: int) -> None:
        """``new`` started in place of ``old``: it continues ``old``'s row."""
        self._row[new] = self._row.pop(old, 0) + 1

    def served(self, replica: int) -> None:
        """``replica`` completed a shard: its line's row ends."""
        if replica in self._row:
            del self._row[replica]
