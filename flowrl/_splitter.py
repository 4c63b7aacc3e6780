"""Splitter policies (layer 3, sans-IO): how many pending samples an idle replica takes.

Every policy is work-conserving (an idle replica asking while samples are pending always gets
at least one) and never exceeds the stage's ``batch_size``. The adaptive policies also bound
a shard by a share of the work that *remains* for the stage — pending now or still to come
from upstream — so shards shrink as the work runs out and replicas finish together
(guided self-scheduling; factoring halves the share again).
"""

from __future__ import annotations

from collections.abc import Callable

from ._errors import ConfigError


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def guided(*, pending: int, remaining: int, replicas: int, batch_size: int) -> int:
    return min(batch_size, pending, max(1, _ceil_div(remaining, replicas)))


def factoring(*, pending: int, remaining: int, replicas: int, batch_size: int) -> int:
    return min(batch_size, pending, max(1, _ceil_div(remaining, 2 * replicas)))


def greedy(*, pending: int, remaining: int, replicas: int, batch_size: int) -> int:
    """Fill the shard up to ``batch_size`` from what is pending (Ray Data / push-like)."""
    del remaining, replicas
    return min(batch_size, pending)


Policy = Callable[..., int]

POLICIES: dict[str, Policy] = {"guided": guided, "factoring": factoring, "greedy": greedy}


def shard_size(policy: str, *, pending: int, remaining: int, replicas: int, batch_size: int) -> int:
    """The size of the next shard; 0 only when nothing is pending."""
    if pending <= 0:
        return 0
    if remaining < pending:
        raise ValueError(f"remaining={remaining} cannot be below pending={pending}")
    try:
        fn = POLICIES[policy]
    except KeyError:
        raise ConfigError(f"unknown splitter {policy!r}; expected one of {sorted(POLICIES)}") from None
    return fn(pending=pending, remaining=remaining, replicas=replicas, batch_size=batch_size)
