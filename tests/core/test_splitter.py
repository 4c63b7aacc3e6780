"""Splitter policies (sans-IO): bounds, shrinking shards, and a whole stage draining."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

import pytest

import flowrl
from flowrl._core.scheduling.call_cost import CallCost
from flowrl._core.scheduling.splitter import shard_size

POLICIES = sorted(flowrl.SPLITTERS)
ADAPTIVE = ["guided", "factoring"]


def _grid():
    """Every (pending, remaining, replicas, batch_size) with remaining >= pending >= 1."""
    for pending, extra, replicas, batch in itertools.product(
        range(1, 13), (0, 1, 2, 5, 17, 40), (1, 2, 3, 7, 8, 16), (1, 2, 3, 4, 8, 64)
    ):
        yield pending, pending + extra, replicas, batch


def _random_cases(seed: int, count: int = 400):
    rng = random.Random(seed)
    for _ in range(count):
        pending = rng.randint(1, 500)
        yield pending, pending + rng.randint(0, 2000), rng.randint(1, 64), rng.randint(1, 256)


def _all_cases():
    yield from _grid()
    yield from _random_cases(seed=20240209)


def _size(policy, pending, remaining, replicas, batch):
    return shard_size(policy, pending=pending, remaining=remaining, replicas=replicas, batch_size=batch)


@pytest.mark.parametrize("policy", POLICIES)
def test_shard_is_work_conserving_and_bounded(policy):
    for pending, remaining, replicas, batch in _all_cases():
        n = _size(policy, pending, remaining, replicas, batch)
        case = (policy, pending, remaining, replicas, batch)
        assert n >= 1, case  # an idle replica asking while samples are pending always gets one
        assert n <= batch, case
        assert n <= pending, case


@pytest.mark.parametrize("policy", POLICIES)
def test_nothing_pending_gives_empty_shard(policy):
    for remaining in (0, 1, 10):
        assert _size(policy, 0, remaining, 4, 8) == 0


def test_guided_never_exceeds_a_replicas_share():
    for pending, remaining, replicas, batch in _all_cases():
        share = max(1, math.ceil(remaining / replicas))
        assert _size("guided", pending, remaining, replicas, batch) <= share


def test_guided_takes_a_full_batch_when_the_share_allows_it():
    for pending, remaining, replicas, batch in _all_cases():
        if pending >= batch and math.ceil(remaining / replicas) >= batch:
            assert _size("guided", pending, remaining, replicas, batch) == batch


def test_factoring_never_larger_than_guided():
    for case in _all_cases():
        assert _size("factoring", *case) <= _size("guided", *case), case


def test_greedy_fills_up_to_batch_size():
    for pending, remaining, replicas, batch in _all_cases():
        assert _size("greedy", pending, remaining, replicas, batch) == min(batch, pending)


@pytest.mark.parametrize("policy", ADAPTIVE)
@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
@pytest.mark.parametrize("batch", [1, 2, 4, 64])
@pytest.mark.parametrize("pending", [1, 3, 10])
def test_adaptive_shards_shrink_as_remaining_shrinks(policy, replicas, batch, pending):
    sizes = [_size(policy, pending, remaining, replicas, batch) for remaining in range(pending, pending + 300)]
    assert sizes == sorted(sizes), "a larger remaining must never give a smaller shard"


@pytest.mark.parametrize("pending", [1, 5])
def test_unknown_policy_is_a_config_error_listing_valid_names(pending):
    with pytest.raises(flowrl.ConfigError) as info:
        _size("fastest", pending, pending, 2, 2)
    msg = str(info.value)
    assert "fastest" in msg
    for name in flowrl.SPLITTERS:
        assert name in msg


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pending,remaining", [(2, 1), (10, 9), (5, 0)])
def test_remaining_below_pending_is_rejected(policy, pending, remaining):
    with pytest.raises(ValueError, match="remaining"):
        _size(policy, pending, remaining, 3, 4)


def drain(policy: str, samples: int, replicas: int, batch: int):
    """All ``samples`` ready at once; replicas take turns asking (0, 1, ..., R-1, 0, ...).

    A replica's previous shard finishes just before it asks again, so ``remaining`` (not yet
    finished) counts what is pending plus the shards the other replicas are running.
    """
    pool = list(range(samples))
    shards: list[tuple[int, list[int]]] = []
    running: dict[int, int] = {}
    finished = turn = 0
    while pool:
        r = turn % replicas
        finished += running.pop(r, 0)
        n = shard_size(
            policy,
            pending=len(pool),
            remaining=samples - finished,
            replicas=replicas,
            batch_size=batch,
            unassigned=len(pool),
            free_replicas=replicas - len(running),
        )
        assert n >= 1
        shards.append((r, pool[:n]))
        running[r] = n
        del pool[:n]
        turn += 1
    return shards


@pytest.mark.parametrize("policy", ADAPTIVE)
def test_a_second_slot_takes_only_what_the_replicas_share_leaves(policy):
    for pending, remaining, replicas, batch in _all_cases():
        for held in (0, 1, 3):
            if remaining < pending + held:
                continue
            n = shard_size(policy, pending=pending, remaining=remaining, replicas=replicas, batch_size=batch, held=held)
            share = math.ceil(remaining / (replicas if policy == "guided" else 2 * replicas))
            assert 1 <= n <= min(batch, pending)
            assert n == 1 or held + n <= share, (policy, pending, remaining, replicas, batch, held, n)


DRAIN_GRID = list(itertools.product([1, 2, 3, 7, 8, 16], [1, 2, 5, 16, 33, 97], [1, 2, 4, 8]))


@pytest.mark.parametrize("policy", POLICIES)
def test_drain_hands_every_sample_out_exactly_once(policy):
    for replicas, samples, batch in DRAIN_GRID:
        shards = drain(policy, samples, replicas, batch)
        handed = Counter(i for _, ids in shards for i in ids)
        assert sorted(handed) == list(range(samples))
        assert set(handed.values()) == {1}
        assert all(len(ids) <= batch for _, ids in shards)


@pytest.mark.parametrize("policy", ADAPTIVE)
def test_drain_shards_are_non_increasing(policy):
    for replicas, samples, batch in DRAIN_GRID:
        sizes = [len(ids) for _, ids in drain(policy, samples, replicas, batch)]
        assert all(a >= b for a, b in itertools.pairwise(sizes)), (replicas, samples, batch, sizes)


@pytest.mark.parametrize("policy", ADAPTIVE)
def test_adaptive_drain_gives_every_replica_work(policy):
    for replicas, samples, batch in DRAIN_GRID:
        workers = {r for r, _ in drain(policy, samples, replicas, batch)}
        assert len(workers) == min(replicas, samples), (replicas, samples, batch)


# The seed issue (ChatLearn #209): 16 samples, 8 reference replicas, batch size 2.
SEED_SAMPLES, SEED_REPLICAS, SEED_BATCH = 16, 8, 2


@pytest.mark.parametrize("policy", POLICIES)
def test_seed_issue_every_replica_gets_work(policy):
    workers = {r for r, _ in drain(policy, SEED_SAMPLES, SEED_REPLICAS, SEED_BATCH)}
    assert len(workers) == min(SEED_REPLICAS, SEED_SAMPLES)


@pytest.mark.parametrize(
    "policy",
    POLICIES,
)
def test_seed_issue_every_replica_gets_exactly_its_share(policy):
    per_replica = Counter()
    for r, ids in drain(policy, SEED_SAMPLES, SEED_REPLICAS, SEED_BATCH):
        per_replica[r] += len(ids)
    share = SEED_SAMPLES // SEED_REPLICAS
    assert dict(per_replica) == dict.fromkeys(range(SEED_REPLICAS), share)


@pytest.mark.parametrize(
    "calls, batch, expected",
    [
        ([], 8, 1),  # nothing measured: spread freely
        ([(2, 0.200, 0.002)], 8, 1),  # GPU-like: 100 ms a sample, 2 ms overhead
        ([(2, 0.014, 0.012)], 2, 2),  # #209 on 2 cores: 7 ms a sample, 12 ms overhead
        ([(8, 0.026, 0.016)], 8, 5),  # 3.25 ms a sample, 16 ms overhead
        ([(1, 0.0015, 0.011)], 1, 1),  # never above the batch size
        ([(4, 0.0, 0.001)], 6, 6),  # free steps: every call is all overhead
    ],
)
def test_shard_floor_is_the_smallest_shard_carrying_a_calls_overhead(calls, batch, expected):
    floor = CallCost(batch)
    for rows, busy, overhead in calls:
        floor.observe(rows, busy, overhead)
    assert floor.floor() == expected


def test_shard_floor_follows_recent_calls():
    floor = CallCost(8, weight=0.5)
    floor.observe(1, 0.010, 0.030)  # 3 samples' work per overhead
    assert floor.floor() == 3
    for _ in range(12):
        floor.observe(1, 0.010, 0.001)  # the machine quietened down
    assert floor.floor() == 1


@pytest.mark.parametrize("policy", ["guided", "factoring"])
def test_a_floor_raises_small_shards_while_enough_is_pending(policy):
    kw = {"pending": 6, "remaining": 6, "replicas": 6, "batch_size": 4}
    assert shard_size(policy, **kw) == 1  # spread over six idle replicas
    assert shard_size(policy, **kw, floor=3) == 3
    assert shard_size(policy, **{**kw, "pending": 2, "remaining": 2}, floor=3) == 2  # only 2 pending
    assert shard_size(policy, **kw, floor=9) == 4  # never above the batch size


def test_shard_floor_counts_a_samples_marginal_time_not_the_calls_fixed_time():
    floor = CallCost(8, weight=0.5)
    for _ in range(6):  # 10 ms a call + 2 ms a sample, 10 ms overhead
        floor.observe(1, 0.012, 0.010)
        floor.observe(2, 0.014, 0.010)
    assert floor.per_sample_s() == pytest.approx(0.002, rel=0.05)
    assert floor.floor() == 5  # 5 samples' work covers a call's overhead


def test_shard_floor_ignores_calls_that_waited_behind_another_shard():
    floor = CallCost(8)
    for _ in range(10):
        floor.observe(2, 0.004, None)  # each queued behind a shard on its replica: overhead unknown
    assert floor.floor() == 1
    floor.observe(2, 0.004, 0.010)  # one that ran alone: 2 ms a sample, 10 ms overhead
    assert floor.floor() == 5


@pytest.mark.parametrize(
    "calls, remaining, replicas, expected",
    [
        ([], 1000, 4, False),  # no call measured yet
        ([(2, 0.004, None)], 1000, 4, False),  # overhead unknown (the call waited behind another)
        ([(1, 0.0015, 0.0007)], 400, 4, True),  # tiny steps: 100 calls each left, 0.7 ms idle each
        ([(1, 0.0015, 0.0007)], 8, 4, False),  # two calls each left: queueing saves less than a step
        ([(16, 0.150, 0.002)], 256, 4, False),  # long steps: 4 calls each save 8 ms, a step is 150 ms
    ],
)
def test_shards_queue_ahead_only_while_the_overhead_saved_exceeds_a_step(calls, remaining, replicas, expected):
    floor = CallCost(16)
    for rows, busy, overhead in calls:
        floor.observe(rows, busy, overhead)
    assert floor.queue_ahead(remaining, replicas) is expected
