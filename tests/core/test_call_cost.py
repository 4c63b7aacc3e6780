"""The cost-aware splitter (sans-IO): the fitted call cost, the size it picks, and waiting for
samples on their way without ever waiting for samples that are not in the pipeline."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from flowrl._core.scheduling.call_cost import CallCost
from flowrl._core.scheduling.scheduler import PoolScheduler
from flowrl._core.scheduling.splitter import shard_size
from flowrl._sim.simulate import simulate
from flowrl._tools.scenarios import scenarios


def _fed(calls, prior=None, batch=16):
    cost = CallCost(batch, prior=prior)
    for rows, busy, overhead in calls:
        cost.observe(rows, busy, overhead)
    return cost


@pytest.mark.parametrize("fixed, per", [(0.015, 0.0005), (0.0, 0.002), (0.030, 0.00001)])
def test_the_fit_separates_a_calls_fixed_time_from_its_per_sample_time(fixed, per):
    calls = [(n, fixed + n * per, 0.002) for _ in range(10) for n in (2, 8, 16)]
    cost = _fed(calls)
    assert cost.per_sample_s() == pytest.approx(per, abs=1e-6)
    assert cost.fixed_s() == pytest.approx(fixed + 0.002, abs=1e-6)  # the overhead is paid per call too


def test_one_stalled_call_does_not_move_the_fit():
    calls = [(n, 0.010 + n * 0.001, 0.001) for _ in range(8) for n in (4, 8)]
    quiet = _fed(calls)
    stalled = _fed([*calls, (8, 2.0, 0.5)])  # a 2 s stall: 100x the call
    assert stalled.predict(8) < 1.5 * quiet.predict(8)
    assert stalled.overhead_s() < 1.5 * quiet.overhead_s()


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_replicas_slow_first_step_does_not_hide_a_calls_fixed_cost(replicas):
    """A GPU replica's first call pays once for CUDA's first kernels: a first call of 64 as slow
    as the calls of 960 after it makes the line fall, or bends it; the fit leaves it out."""
    fixed, per = 0.2, 1e-4
    first = [(r, 64, 0.5 + fixed + 64 * per) for r in range(replicas)]  # 0.5 s once, then as the fit
    calls = first + [(r, n, fixed + n * per) for _ in range(2) for r in range(replicas) for n in (960, 64)]
    known, unknown = CallCost(1024), CallCost(1024)
    for r, n, seconds in calls:
        known.observe(n, seconds, None, replica=r)
        unknown.observe(n, seconds, None)
    assert known.fixed_s() == pytest.approx(fixed, rel=0.05)
    assert known.per_sample_s() == pytest.approx(per, rel=0.1)
    assert abs(unknown.fixed_s() - fixed) > 0.1 * fixed  # the first steps counted: the fit is off


def test_a_first_step_that_is_not_slow_counts():
    cost = CallCost(1024)
    cost.observe(64, 0.2064, None, replica=0)
    cost.observe(960, 0.296, None, replica=0)
    assert cost.fixed_s() == pytest.approx(0.2) and cost.per_sample_s() == pytest.approx(1e-4)


def test_a_prior_stands_until_calls_are_measured_and_splits_a_single_size_as_it_says():
    cost = CallCost(16, prior=(0.020, 0.001))
    assert cost.fixed_s() == pytest.approx(0.020) and cost.per_sample_s() == pytest.approx(0.001)
    cost.observe(8, 0.056, None)  # twice the prior's 28 ms: one size seen, its time split 20:8
    assert cost.fixed_s() == pytest.approx(0.040) and cost.per_sample_s() == pytest.approx(0.002)


def test_without_a_prior_nothing_is_known_before_a_call():
    cost = CallCost(8)
    assert cost.best_size(100, 4) is None and cost.fixed_s() is None and cost.floor() == 1


@pytest.mark.parametrize(
    "fixed, per, unassigned, replicas, batch",
    [(0.015, 0.0005, 256, 16, 64), (0.010, 0.002, 256, 8, 64), (0.001, 0.010, 64, 8, 64), (0.02, 0.001, 4, 8, 64)],
)
def test_best_size_minimises_the_predicted_finish(fixed, per, unassigned, replicas, batch):
    cost = CallCost(batch, prior=(fixed, per))
    size = cost.best_size(unassigned, replicas)

    def finish(s: int) -> float:  # the model the size comes from
        return unassigned / replicas * (per + fixed / s) + s * per / 2

    best = min(range(1, batch + 1), key=finish)
    assert abs(size - best) <= 1
    assert finish(size) <= 1.01 * finish(best)


def test_free_samples_fill_the_batch():
    assert CallCost(12, prior=(0.010, 0.0)).best_size(100, 4) == 12


def _cost(pending, remaining, replicas, batch, *, target, coming, held=0, floor=1):
    return shard_size(
        "cost",
        pending=pending,
        remaining=remaining,
        replicas=replicas,
        batch_size=batch,
        held=held,
        unassigned=remaining - held,
        target=target,
        coming=coming,
        floor=floor,
    )


def test_cost_waits_for_samples_on_their_way_and_never_for_ones_not_admitted():
    assert _cost(2, 64, 4, 16, target=8, coming=20) == 0  # 20 more are upstream: wait for 8
    assert _cost(2, 64, 4, 16, target=8, coming=0) == 2  # none coming: take what there is
    assert _cost(9, 64, 4, 16, target=8, coming=20) == 9  # enough pending: at least the target


def test_cost_stays_within_the_share_but_not_below_the_overhead_floor():
    assert _cost(16, 16, 8, 16, target=12, coming=0) == 2  # 16 left over 8 replicas: 2 each
    assert _cost(16, 16, 8, 16, target=12, coming=0, floor=5) == 5  # each call's overhead needs 5


def test_cost_is_bounded_by_pending_and_the_batch_size():
    rng = random.Random(22)
    for _ in range(2000):
        batch, replicas = rng.randint(1, 64), rng.randint(1, 32)
        pending = rng.randint(1, 200)
        remaining = pending + rng.randint(0, 500)
        n = _cost(pending, remaining, replicas, batch, target=rng.randint(1, 80), coming=rng.choice([0, 5]))
        assert 0 <= n <= min(batch, pending)
        if n == 0:
            assert pending < batch


def test_a_pool_that_waits_still_hands_out_every_sample():
    """Samples trickle in one by one; the stage waits for its target while more are on the way,
    and never past the last: every sample is dispatched exactly once."""
    pool = PoolScheduler(replicas=3, policy="cost", prefetch=1)
    pool.add_stage("s", 16, prior=(0.05, 0.001))  # launch-bound: big shards pay
    pool.expect("s", 40)
    pool.admit("s", 40)
    for r in range(3):
        pool.request(r)
    got: list[int] = []
    shards = 0
    for sid in range(40):
        pool.ready("s", [sid])
        for a in pool.poll():
            got += a.ids
            shards += 1
            pool.finish(a)
            pool.request(a.replica)
    assert sorted(got) == list(range(40))
    assert pool.pending == 0
    assert shards < 20  # it did wait: one sample at a time would be 40 calls


def test_samples_only_expected_are_never_waited_for():
    """An unsized source: the stage expects more but none is admitted: it must not wait."""
    pool = PoolScheduler(replicas=2, policy="cost", prefetch=1)
    pool.add_stage("s", 16, prior=(0.05, 0.001))
    pool.expect("s", 100)
    pool.admit("s", 3)
    pool.request(0)
    pool.ready("s", [0, 1, 2])
    (a,) = pool.poll()
    assert a.ids == [0, 1, 2]


def test_on_launch_bound_calls_cost_cuts_fewer_calls_than_guided_and_finishes_no_later():
    w = scenarios()["fixed-call-cost"]
    w = msgspec.structs.replace(w, overhead_s=0.002, dispatch_s=0.0008)  # a 2-core machine's costs
    runs = {
        name: simulate(msgspec.structs.replace(w, stages=[msgspec.structs.replace(s, splitter=name) for s in w.stages]))
        for name in ("guided", "cost")
    }
    assert sum(runs["cost"].calls.values()) < sum(runs["guided"].calls.values())
    assert runs["cost"].makespan_s <= runs["guided"].makespan_s * 1.01
    assert math.isfinite(runs["cost"].ratio)


def test_queue_ahead_where_calls_last_as_predicted():
    steady = _fed([(8, 0.019, 0.004)] * 8)  # deviation 0 < 4 ms overhead; 4 calls each left
    assert steady.queue_ahead(remaining=256, replicas=8)
    assert not steady.queue_ahead(remaining=8, replicas=8)  # the last call: nothing to queue behind
    tails = _fed([(8, 0.019 if i % 2 else 0.120, 0.004) for i in range(8)])  # calls vary far more
    assert not tails.queue_ahead(remaining=256, replicas=8)
