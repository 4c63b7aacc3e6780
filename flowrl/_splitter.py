"""Splitter policies (layer 3, sans-IO): how many pending samples an idle replica takes.

Every policy is work-conserving (a replica asking while samples are pending always gets at
least one) and never exceeds the stage's ``batch_size``. The adaptive policies also bound what
a replica holds by its share of the work that *remains* for the stage — not yet finished:
pending now, still to come from upstream, or running — so shards shrink as the work runs out
and replicas finish together (guided self-scheduling; factoring halves the share again).
``held`` is what the asking replica already holds of this stage, so a second (prefetch) slot
only takes what the replica's share leaves.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ._errors import ConfigError


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _adaptive(divisor: int, pending: int, remaining: int, replicas: int, batch_size: int, held: int,
              unassigned: int | None, free_replicas: int | None) -> int:
    # Two bounds: the replica's share of all unfinished work, less what it already runs
    # (guided self-scheduling), and an even split of the not-yet-assigned work over the
    # replicas that hold none of it, so a wave of samples reaches every idle replica.
    share = _ceil_div(remaining, divisor * replicas) - held
    unassigned = remaining if unassigned is None else unassigned
    spread = _ceil_div(unassigned, max(1, replicas if free_replicas is None else free_replicas))
    return min(batch_size, pending, max(1, min(share, spread)))


def guided(*, pending: int, remaining: int, replicas: int, batch_size: int, held: int = 0,
           unassigned: int | None = None, free_replicas: int | None = None) -> int:
    return _adaptive(1, pending, remaining, replicas, batch_size, held, unassigned, free_replicas)


def factoring(*, pending: int, remaining: int, replicas: int, batch_size: int, held: int = 0,
              unassigned: int | None = None, free_replicas: int | None = None) -> int:
    return _adaptive(2, pending, remaining, replicas, batch_size, held, unassigned, free_replicas)


def greedy(*, pending: int, batch_size: int, **_: int | None) -> int:
    """Fill the shard up to ``batch_size`` from what is pending (Ray Data / push-like)."""
    return min(batch_size, pending)


Policy = Callable[..., int]

POLICIES: dict[str, Policy] = {"guided": guided, "factoring": factoring, "greedy": greedy}


def policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown splitter {name!r}; expected one of {sorted(POLICIES)}") from None


def shard_size(
    name: str, *, pending: int, remaining: int, replicas: int, batch_size: int, held: int = 0,
    unassigned: int | None = None, free_replicas: int | None = None, floor: int = 1,
) -> int:
    """The size of the next shard; 0 only when nothing is pending.

    ``remaining``: samples of the stage not finished (pending, still upstream, running);
    ``unassigned``: not yet handed to any replica (pending and still upstream; default
    ``remaining``); ``held``: samples the asking replica runs already; ``free_replicas``:
    replicas running none of the stage's samples (default ``replicas``); ``floor``: the
    adaptive policies cut no shard smaller than this while enough is pending (``ShardFloor``).
    """
    fn = policy(name)
    if pending <= 0:
        return 0
    if remaining < pending + held:
        raise ValueError(f"remaining={remaining} cannot be below pending={pending} + held={held}")
    n = fn(pending=pending, remaining=remaining, replicas=replicas, batch_size=batch_size, held=held,
           unassigned=unassigned, free_replicas=free_replicas)
    return max(n, min(floor, pending, batch_size))


class ShardFloor:
    """The smallest shard worth a call, from measured calls: one that carries at least as much
    work as a call's overhead (its time outside the step: transport, dispatch, waiting for a
    CPU). Where model time dominates (a GPU), this is 1 and the splitter spreads freely; where
    calls are short and overhead long, spreading a wave over every idle replica would cost
    more than it saves, so shards stay fuller. Recent calls weigh more (moving averages).
    """

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.per_sample_s: float | None = None
        self.overhead_s: float | None = None

    def observe(self, rows: int, busy_s: float, overhead_s: float) -> None:
        if rows <= 0:
            return
        self.per_sample_s = self._mix(self.per_sample_s, busy_s / rows)
        self.overhead_s = self._mix(self.overhead_s, overhead_s)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def floor(self, batch_size: int) -> int:
        if self.per_sample_s is None or self.overhead_s is None:
            return 1
        if self.per_sample_s <= 0:
            return batch_size
        return max(1, min(batch_size, math.ceil(self.overhead_s / self.per_sample_s - 1e-9)))
