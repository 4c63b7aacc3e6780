"""The autoscaling policy (sans-IO: no Ray, no event loop).

Fed one ``Reading`` per autoscaled model at every tick of an active run, it answers with the
pools to grow or shrink. A pool grows when its queue stays long (every serving replica has at
least ``grow_queue`` batches waiting), by as many replicas as would bring the queue down to
that, within ``max_replicas`` and the cluster's free resources. It shrinks when its replicas
stay starved (at least ``shrink_starved`` of their time without a shard, nothing waiting) to
the replicas' worth of work they did, never below ``min_replicas``. Either needs ``patience``
readings in a row; a decision starts the count again. Shrinks come first in a tick, and what
they free is there for the grows of the same tick.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..settings.config import Autoscale


class Reading(msgspec.Struct, frozen=True, kw_only=True):
    """One model's pool over the last tick."""

    model: str
    serving: int  # replicas serving (not removed, not dead)
    queued: int  # samples waiting for the model's stages now
    starved: float  # fraction of the serving replicas' time with no shard, over the tick
    batch_size: int
    cpus: float = 0.0  # what one replica asks for
    gpus: float = 0.0


class ScaleEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A pool resized: by the autoscaler (with the reading behind it), on request, or to replace
    a replica that died or hung (``recovery_s``: seconds from that noticed to the new replica
    serving, the backoff included; None for other resizes)."""

    model: str
    action: str  # "grow" | "shrink"
    before: int
    after: int
    reason: str
    time: float = 0.0  # wall clock, set when applied
    reading: Reading | None = None
    recovery_s: float | None = None


class AutoscalePolicy:
    def __init__(self, configs: Mapping[str, Autoscale]) -> None:
        self.configs = dict(configs)
        self._streak: dict[str, tuple[str, int]] = {}  # model -> (the action it points to, readings in a row)

    def reset(self) -> None:
        """No run is active: readings in a row start again."""
        self._streak.clear()

    def decide(self, readings: list[Reading], free: Mapping[str, float]) -> list[ScaleEvent]:
        """The resizes to make, shrinks first: what they free counts in ``free`` (the
        cluster's free resources, by Ray's names ``CPU`` and ``GPU``) for the grows after."""
        free = dict(free)
        shrinks = [e for e in (self._one(r, free) for r in readings if not self._grows(r)) if e is not None]
        for e in shrinks:
            assert e.reading is not None
            free["CPU"] = free.get("CPU", 0.0) + (e.before - e.after) * e.reading.cpus
            free["GPU"] = free.get("GPU", 0.0) + (e.before - e.after) * e.reading.gpus
        grows = [e for e in (self._one(r, free) for r in readings if self._grows(r)) if e is not None]
        return shrinks + grows

    def _grows(self, r: Reading) -> bool:
        return r.queued / max(1, r.serving) / r.batch_size >= self.configs[r.model].grow_queue

    def _one(self, r: Reading, free: dict[str, float]) -> ScaleEvent | None:
        cfg = self.configs[r.model]
        per_replica = r.queued / max(1, r.serving) / r.batch_size  # batches waiting per replica
        action, target, reason = "", r.serving, ""
        if per_replica >= cfg.grow_queue and r.serving < cfg.max_replicas:
            wanted = math.ceil(r.queued / (cfg.grow_queue * r.batch_size))  # replicas for that queue
            target = min(cfg.max_replicas, r.serving + room(r, free), max(wanted, r.serving + 1))
            action = "grow"
            reason = f"{per_replica:.2f} batches waiting per replica >= grow_queue={cfg.grow_queue:g}"
        elif r.starved >= cfg.shrink_starved and r.queued == 0 and r.serving > cfg.min_replicas:
            needed = math.ceil(r.serving * (1 - r.starved) - 1e-9)  # the replicas' worth of work there was
            target = max(cfg.min_replicas, min(r.serving - 1, needed))
            action = "shrink"
            reason = f"starved {r.starved:.0%} of the time >= shrink_starved={cfg.shrink_starved:.0%}"
        if not action:
            self._streak.pop(r.model, None)
            return None
        last, count = self._streak.get(r.model, ("", 0))
        count = count + 1 if last == action else 1
        if count < cfg.patience or target == r.serving:
            self._streak[r.model] = (action, count)
            return None
        self._streak.pop(r.model, None)
        if action == "grow":  # taken from what the next grows may use
            free["CPU"] = free.get("CPU", 0.0) - (target - r.serving) * r.cpus
            free["GPU"] = free.get("GPU", 0.0) - (target - r.serving) * r.gpus
        return ScaleEvent(model=r.model, action=action, before=r.serving, after=target, reason=reason, reading=r)


def room(r: Reading, free: Mapping[str, float]) -> int:
    """How many more replicas like ``r``'s the free resources hold."""
    fits = [free.get(key, 0.0) / need for key, need in (("CPU", r.cpus), ("GPU", r.gpus)) if need > 0]
    return max(0, int(min(min(fits), 1 << 20) + 1e-9)) if fits else 1 << 20
