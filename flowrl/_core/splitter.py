"""Splitter policies (sans-IO): how many pending samples an idle replica takes.

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

from .errors import ConfigError


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _adaptive(
    divisor: int,
    pending: int,
    remaining: int,
    replicas: int,
    batch_size: int,
    held: int,
    unassigned: int | None,
    free_replicas: int | None,
) -> int:
    # Two bounds: the replica's share of all unfinished work, less what it already runs
    # (guided self-scheduling), and an even split of the not-yet-assigned work over the
    # replicas that hold none of it, so a wave of samples reaches every idle replica.
    share = _ceil_div(remaining, divisor * replicas) - held
    unassigned = remaining if unassigned is None else unassigned
    spread = _ceil_div(unassigned, max(1, replicas if free_replicas is None else free_replicas))
    return min(batch_size, pending, max(1, min(share, spread)))


def guided(
    *,
    pending: int,
    remaining: int,
    replicas: int,
    batch_size: int,
    held: int = 0,
    unassigned: int | None = None,
    free_replicas: int | None = None,
) -> int:
    return _adaptive(1, pending, remaining, replicas, batch_size, held, unassigned, free_replicas)


def factoring(
    *,
    pending: int,
    remaining: int,
    replicas: int,
    batch_size: int,
    held: int = 0,
    unassigned: int | None = None,
    free_replicas: int | None = None,
) -> int:
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
    name: str,
    *,
    pending: int,
    remaining: int,
    replicas: int,
    batch_size: int,
    held: int = 0,
    unassigned: int | None = None,
    free_replicas: int | None = None,
    floor: int = 1,
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
    n = fn(
        pending=pending,
        remaining=remaining,
        replicas=replicas,
        batch_size=batch_size,
        held=held,
        unassigned=unassigned,
        free_replicas=free_replicas,
    )
    return max(n, min(floor, pending, batch_size))


class ShardFloor:
    """The smallest shard worth a call, from measured calls: one whose samples' work covers a
    call's overhead (its time outside the step: transport, dispatch, waiting for a CPU).

    The work of a sample is the step's marginal time per sample, fitted as ``busy = a + b * n``
    over recent calls (moving averages); a call's fixed time ``a`` is not counted, since each
    replica pays its own, while the overhead loads what replicas share (the driver, the CPUs).
    While every call had the same size there is nothing to fit and ``busy / n`` stands in.
    Where model time dominates (a GPU) the floor is 1 and the splitter spreads freely; where
    steps are short and calls costly, waves are not spread thinner than they are worth.
    """

    def __init__(self, batch_size: int, weight: float = 0.2) -> None:
        self.batch_size, self.weight = batch_size, weight
        self._avg: dict[str, float] = {}  # moving averages: n, busy, n*n, n*busy, overhead

    def observe(self, rows: int, busy_s: float, overhead_s: float | None) -> None:
        """One completed call; ``overhead_s`` None when it is not known (the call waited
        behind another shard on its replica, so its time outside the step says nothing)."""
        if rows <= 0:
            return
        new = {"n": rows, "y": busy_s, "nn": rows * rows, "ny": rows * busy_s}
        if overhead_s is not None:
            new["o"] = overhead_s
        for key, value in new.items():
            old = self._avg.get(key)
            self._avg[key] = value if old is None else old + self.weight * (value - old)

    def per_sample_s(self) -> float | None:
        """The step's marginal time per sample (None before any call)."""
        if not self._avg:
            return None
        m = self._avg
        var = m["nn"] - m["n"] ** 2
        if var > 0.01 * m["nn"]:  # several sizes seen: fit the slope
            slope = (m["ny"] - m["n"] * m["y"]) / var
            if slope > 0:
                return slope
        return m["y"] / m["n"]

    def queue_ahead(self, remaining: int, replicas: int) -> bool:
        """Whether a replica should get its next shard before its current one ends (prefetch).

        Queued, a shard saves the replica the call's overhead of idling between calls; but
        one queued behind a long call (a heavy tail as the episode drains) can wait far longer,
        while another replica idles. So: only while the overhead saved over the calls each
        replica has left (``remaining`` samples of the stage) exceeds one call's step time,
        which stops well before the drain; and not before a call's overhead is known.
        """
        m = self._avg
        return "o" in m and m["o"] * remaining / (replicas * m["n"]) >= m["y"]

    def floor(self) -> int:
        per_sample = self.per_sample_s()
        if per_sample is None or "o" not in self._avg:
            return 1
        if per_sample <= 0:
            return self.batch_size
        return max(1, min(self.batch_size, math.ceil(self._avg["o"] / per_sample - 1e-9)))
