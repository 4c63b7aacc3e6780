"""The roster: the replicas a pipeline serves with, and since when each waits for work."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Collection

    from .._backends.specs import ReplicaHandle
    from .._core.observe.pipeline_stats import StatsRecorder

Key = tuple[str, int]  # (model, replica)


class Roster:
    """Replica handles, and the open starvation interval of each replica with nothing to run."""

    def __init__(self, handles: list[ReplicaHandle], recorder: StatsRecorder) -> None:
        self.handles = list(handles)
        self._recorder = recorder
        started = time.perf_counter()  # every replica waits for work from the start
        self._hungry: dict[Key, float] = {(h.model, h.replica_id): started for h in handles}
        self._dead: set[Key] = set()  # replicas whose process died: they stay listed until close

    def of(self, model: str) -> list[ReplicaHandle]:
        """``model``'s replicas but the dead ones: those a weight sync sends to."""
        return [h for h in self.handles if h.model == model and (h.model, h.replica_id) not in self._dead]

    def died(self, handle: ReplicaHandle) -> None:
        """``handle``'s process is gone; its actor is cleaned up at close with the others."""
        self._dead.add((handle.model, handle.replica_id))

    def join(self, handle: ReplicaHandle) -> None:
        self.handles.append(handle)
        self.hungry(handle.model, handle.replica_id)

    def leave(self, model: str, replicas: Collection[int]) -> list[ReplicaHandle]:
        """Drop these replicas of ``model`` (their starvation is counted); the handles dropped."""
        gone = [h for h in self.handles if h.model == model and h.replica_id in replicas]
        self.handles = [h for h in self.handles if h not in gone]
        for r in replicas:
            self.fed(model, r)
        return gone

    def hungry(self, model: str, replica: int) -> None:
        """``replica`` has nothing to run from now on."""
        self._hungry[(model, replica)] = time.perf_counter()

    def fed(self, model: str, replica: int) -> None:
        since = self._hungry.pop((model, replica), None)
        if since is not None:
            self._recorder.starved(model, replica, time.perf_counter() - since)

    def waiting(self, now: float) -> dict[Key, float]:
        """Per replica with nothing to run: seconds so far."""
        return {key: now - since for key, since in self._hungry.items()}

    def open_starvation(self, model: str, now: float, retired: Collection[int]) -> float:
        """Seconds ``model``'s replicas (but ``retired`` ones) have waited so far in open intervals."""
        return sum(now - since for (m, r), since in self._hungry.items() if m == model and r not in retired)
