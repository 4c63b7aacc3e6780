"""The cost splitter's drain rule (sans-IO): the last samples of a stage, shared so that
replicas free at different times finish together (``call_cost.drain_share``)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl._core.scheduling.call_cost import drain_share
from flowrl._core.scheduling.scheduler import PoolScheduler
from flowrl._sim.epochs import prompt_keys
from flowrl._sim.simulate import _Sim, tails
from flowrl._tools.scenarios import scenarios


def _together(frees: list[float], samples: int, fixed: float, per: float, batch: int) -> float:
    """The finish of the continuous split, by bisection (independent of the walk over breakpoints)."""

    def done(t: float) -> float:
        return sum(min(batch, max(0.0, (t - f - fixed) / per)) for f in frees)

    lo, hi = min(frees), max(frees) + fixed + per * batch
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if done(mid) < samples else (lo, mid)
    return hi


@settings(max_examples=300, deadline=None)
@given(
    frees=st.lists(st.floats(0.0, 0.05), min_size=1, max_size=12),
    batch=st.integers(2, 16),
    fixed=st.floats(0.0, 0.02),
    per=st.floats(0.0001, 0.005),
    data=st.data(),
)
def test_replicas_asking_as_they_free_up_hand_out_every_sample_and_finish_within_a_sample_of_together(
    frees, batch, fixed, per, data
):
    samples = data.draw(st.integers(1, len(frees) * batch))
    target = _together(frees, samples, fixed, per, batch)
    left, ends, free = samples, [], list(frees)
    asking = sorted((f, i) for i, f in enumerate(frees))  # (when it asks, replica)
    while left:
        assert asking, "every replica declined while samples were left"
        now, i = asking.pop(0)
        others = [max(now, f) for j, f in enumerate(free) if j != i]
        share = drain_share(now, others, left, fixed, per, batch)
        assert 0 <= share <= min(batch, left)
        if share:  # busy until its call ends, then it asks again
            free[i] = now + fixed + per * share
            ends.append(free[i])
            asking.append((free[i], i))
            asking.sort()
        left -= share
    assert max(ends) <= target + per + 1e-9


def test_replicas_free_together_split_evenly():
    assert drain_share(0.0, [0.0] * 7, 16, 0.010, 0.002, 8) == 2


def test_a_free_replica_takes_more_while_the_others_finish_their_calls():
    # 16 samples left: 2 replicas free now, 6 free in 6 ms (guided would hand the free ones 8 each)
    assert drain_share(0.0, [0.0] + [0.006] * 6, 16, 0.010, 0.002, 8) == 5


def test_a_replica_free_after_the_others_would_finish_takes_nothing():
    assert drain_share(0.050, [0.0] * 7, 16, 0.010, 0.002, 8) == 0


def test_more_than_a_call_each_is_not_a_drain_and_samples_free_of_cost_take_none():
    assert drain_share(0.0, [0.0] * 7, 65, 0.010, 0.002, 8) == 8
    assert drain_share(0.0, [0.0] * 7, 16, 0.010, 0.0, 8) == 0


def _pool(clock: list[float] | None) -> PoolScheduler:
    pool = PoolScheduler(replicas=8, policy="cost", prefetch=1, clock=None if clock is None else lambda: clock[0])
    pool.add_stage("s", 8, prior=(0.010, 0.002))
    for _ in range(8):  # calls that last as the prior says: the fit is steady
        pool.measure("s", 8, 0.026, 0.0)
    return pool


@pytest.mark.parametrize("with_clock", [True, False])
def test_at_the_drain_the_scheduler_shares_by_when_replicas_free_up(with_clock):
    clock = [0.0]
    pool = _pool(clock if with_clock else None)
    pool.expect("s", 64)
    pool.admit("s", 64)
    for r in range(8):
        pool.request(r)
    pool.ready("s", list(range(48)))
    first = pool.poll()  # 48 now, 16 still upstream: not the drain
    assert sorted(len(a.ids) for a in first) == [8] * 6
    clock[0] = 0.020  # the six calls of 26 ms end in 6 ms
    pool.ready("s", list(range(48, 64)))
    last = pool.poll()  # the two idle replicas; nothing else is coming
    assert [len(a.ids) for a in last] == ([5, 5] if with_clock else [8, 8])


def test_a_stage_whose_calls_vary_is_not_drained_by_the_fit():
    clock = [0.0]
    pool = PoolScheduler(replicas=4, policy="cost", prefetch=1, clock=lambda: clock[0])
    pool.add_stage("s", 8, prior=(0.010, 0.002))
    for k in range(8):  # a generation tail: calls last 2x-10x one another
        pool.measure("s", 8, 0.030 if k % 2 else 0.300, 0.0)
    pool.expect("s", 8)
    pool.admit("s", 8)
    pool.ready("s", list(range(8)))
    for r in range(4):
        pool.request(r)
    assert [len(a.ids) for a in pool.poll()] == [2, 2, 2, 2]  # guided's even split, as before


def test_the_second_epoch_of_heavy_tail_epochs_ends_sooner_with_the_drain_rule():
    w = scenarios()["heavy-tail-epochs"]
    keys = np.array(prompt_keys(w))
    first = tails(msgspec.structs.replace(w, epoch=0))["policy"]
    memory = np.array([first[keys == k].mean() for k in keys])
    second = msgspec.structs.replace(w, epoch=1)
    on = _Sim(second, memory)
    off = _Sim(second, memory)
    for pool in off.pools.values():
        pool._clock = None
    on.run()
    off.run()
    assert on.result().makespan_s < off.result().makespan_s - 0.003


@pytest.mark.parametrize(
    ("micro_batches", "steady", "prefetch", "expected"),
    [
        (4, True, 1, 8),  # no shard queued ahead: the overhead against the calls saved, at most 4 steps
        (4, True, 2, 4),  # queued ahead: 2 steps (20 ms) cover the next shard's 20 ms of overhead
        (1, True, 1, 2),
        (4, False, 1, 2),  # a tail: one step a shard, so that the last samples spread
    ],
)
def test_a_cost_shard_holds_several_micro_batches_only_where_calls_are_steady_and_merging_pays(
    micro_batches: int, steady: bool, prefetch: int, expected: int
) -> None:
    pool = PoolScheduler(replicas=2, policy="cost", prefetch=prefetch)
    pool.add_stage("s", 2, micro_batches=micro_batches)
    for k in range(8):  # steps of 2 samples, 10 ms each (or 2 ms and 30 ms), 20 ms of overhead a call
        pool.measure("s", 2, 0.010 if steady else (0.002 if k % 2 else 0.030), 0.020)
    pool.expect("s", 200)
    pool.admit("s", 200)
    pool.ready("s", list(range(200)))
    pool.request(0)
    assert [len(a.ids) for a in pool.poll()] == [expected]


@pytest.mark.parametrize(("shard_s", "expected"), [(0.0, 1), (0.003, 3), (0.020, 8)])
def test_a_replicas_own_cost_a_call_puts_more_micro_batches_in_a_shard_even_when_queued_ahead(
    shard_s: float, expected: int
) -> None:
    # batch size 1, a 30 ms step, 1 ms of overhead (hidden by the shard queued ahead), and the
    # replica's own time a call around its steps: sqrt(100 steps * shard_s / 30 ms) steps, at most 8
    pool = PoolScheduler(replicas=2, policy="cost", prefetch=2)
    pool.add_stage("s", 1, micro_batches=8)
    for _ in range(8):
        pool.measure("s", 1, 0.030 + shard_s, 0.001, shard_s=shard_s)
    pool.expect("s", 200)
    pool.admit("s", 200)
    pool.ready("s", list(range(200)))
    pool.request(0)
    assert [len(a.ids) for a in pool.poll()] == [expected]
