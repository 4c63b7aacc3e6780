"""Splitter policies (sans-IO): how many pending samples an idle replica takes.

Every policy but ``cost`` is work-conserving (a replica asking while samples are pending always
gets at least one; ``cost`` may wait for samples already on their way from upstream), and none
exceeds the stage's ``batch_size``. The adaptive policies also bound what
a replica holds by its share of the work that *remains* for the stage — not yet finished:
pending now, still to come from upstream, or running — so shards shrink as the work runs out
and replicas finish together (guided self-scheduling; factoring halves the share again).
``held`` is what the asking replica already holds of this stage, so a second (prefetch) slot
only takes what the replica's share leaves.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ConfigError


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


def cost(
    *,
    pending: int,
    remaining: int,
    replicas: int,
    batch_size: int,
    held: int = 0,
    unassigned: int | None = None,
    free_replicas: int | None = None,
    target: int | None = None,
    coming: int = 0,
    floor: int = 1,
    most: int | None = None,
) -> int:
    """``guided``, with shards no smaller than ``target`` (the size that minimises the predicted
    finish of the stage's work, from ``CallCost.best_size``) within the replica's share, nor
    than ``floor`` (a shard whose work covers the call's overhead, which loads what replicas
    share); while fewer are pending and ``coming`` more samples are on their way from upstream,
    0: wait for them rather than pay a call's cost for a few. Without either, ``guided``.
    ``most``: the most samples of a call (several micro-batches of ``batch_size``), which only
    ``target`` and ``floor`` may ask for; guided's spread stays within one micro-batch."""
    n = _adaptive(1, pending, remaining, replicas, batch_size, held, unassigned, free_replicas)  # guided
    most = max(batch_size, most or batch_size)
    # wait only for the size the cost model asks within the share, not for the overhead floor:
    # near the drain the floor would hold the last samples back for stragglers upstream
    want = min(most, max(1, min(target or 1, _ceil_div(remaining, replicas) - held)))
    if pending < want and coming > 0:
        return 0
    return max(n, min(max(want, floor), pending, most))


def greedy(*, pending: int, batch_size: int, **_: int | None) -> int:
    """Fill the shard up to ``batch_size`` from what is pending (Ray Data / push-like)."""
    return min(batch_size, pending)


Policy = Callable[..., int]

POLICIES: dict[str, Policy] = {"cost": cost, "guided": guided, "factoring": factoring, "greedy": greedy}


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
    target: int | None = None,
    coming: int = 0,
    most: int | None = None,
) -> int:
    """The size of the next shard; 0 when nothing is pending, or when ``cost`` waits.

    ``remaining``: samples of the stage not finished (pending, still upstream, running);
    ``unassigned``: not yet handed to any replica (pending and still upstream; default
    ``remaining``); ``held``: samples the asking replica runs already; ``free_replicas``:
    replicas running none of the stage's samples (default ``replicas``); ``floor``: the
    adaptive policies cut no shard smaller than this while enough is pending (``CallCost.floor``);
    ``target`` and ``coming``: the ``cost`` policy's best shard size and the samples still
    upstream of the stage (admitted, not yet ready for it); ``most``: ``cost``'s largest call.
    """
    fn = policy(name)
    if pending <= 0:
        return 0
    if remaining < pending + held:
        raise ValueError(f"remaining={remaining} cannot be below pending={pending} + held={held}")
    extra = {"target": target, "coming": coming, "floor": floor, "most": most} if fn is cost else {}
    n = fn(
        **extra,
        pending=pending,
        remaining=remaining,
        replicas=replicas,
        batch_size=batch_size,
        held=held,
        unassigned=unassigned,
        free_replicas=free_replicas,
    )
    if n == 0 or fn is cost:
        return n
    return max(n, min(floor, pending, batch_size))
