"""PoolScheduler (sans-IO): pull matchmaking between waiting slots and ready samples."""

from __future__ import annotations

import random
from collections import Counter

import pytest

import flowrl
from flowrl._core.scheduling.scheduler import Assignment, PoolScheduler

STAGE = "m.forward_step"


def make(replicas=2, policy="greedy", prefetch=1, batch=1, expected=0, stages=(STAGE,), eager=False):
    """A scheduler; ``eager``: calls measured with an overhead as long as their step, so
    prefetch slots queue shards ahead (and the smallest shard worth a call stays 1)."""
    s = PoolScheduler(replicas=replicas, policy=policy, prefetch=prefetch)
    for name in stages:
        s.add_stage(name, batch)
        if expected:
            s.expect(name, expected)
        if eager:
            s.measure(name, 1, 0.001, 0.001)
    return s


@pytest.mark.parametrize("policy", sorted(flowrl.SPLITTERS))
def test_no_assignment_without_a_request(policy):
    s = make(replicas=3, policy=policy, batch=4, expected=10)
    s.ready(STAGE, list(range(10)))
    assert s.poll() == []
    assert s.pending == 10  # nothing was cut ahead of a request
    s.request(1)
    (a,) = s.poll()
    assert a.replica == 1 and a.stage == STAGE and a.ids
    assert s.pending == 10 - len(a.ids)


def test_no_assignment_without_pending_samples():
    s = make(replicas=2, expected=3)
    s.request(0)
    s.request(1)
    assert s.poll() == []
    assert s.poll() == []  # polling again does not invent work
    s.ready(STAGE, [7])
    assert s.poll() == [Assignment(0, STAGE, [7])]  # the slot that waited longest
    s.ready(STAGE, [8])
    assert s.poll() == [Assignment(1, STAGE, [8])]


def test_replicas_with_fewer_shards_in_flight_first():
    s = make(replicas=3, prefetch=2, expected=4, eager=True)
    for r in (0, 0, 1, 2):  # replica 0 asks twice before the others ask once
        s.request(r)
    s.ready(STAGE, [0, 1, 2])
    assert [a.replica for a in s.poll()] == [0, 1, 2]
    s.ready(STAGE, [3])
    assert [a.replica for a in s.poll()] == [0]
    assert s.in_flight == [2, 1, 1]


def test_fewer_in_flight_beats_waiting_or_served_longer_ago():
    s = make(replicas=2, prefetch=2, expected=3)
    s.request(0)
    s.ready(STAGE, [0])
    assert [a.replica for a in s.poll()] == [0]  # replica 0 keeps this shard running
    s.request(1)
    s.ready(STAGE, [1])
    (a1,) = s.poll()
    assert a1.replica == 1
    s.finish(a1)  # replica 1 is idle again, though served more recently than replica 0
    s.request(0)
    s.request(1)
    s.ready(STAGE, [2])
    assert [a.replica for a in s.poll()] == [1]


def test_equal_in_flight_served_least_recently_served_first():
    s = make(replicas=3, expected=6)
    s.request(1)
    s.ready(STAGE, [0])
    (a1,) = s.poll()
    assert a1.replica == 1
    s.finish(a1)
    s.request(1)  # replica 1 asks first, but it was served most recently
    s.request(2)
    s.request(0)
    s.ready(STAGE, [1, 2, 3])
    served = [a.replica for a in s.poll()]
    assert served[-1] == 1 and sorted(served) == [0, 1, 2]


@pytest.mark.parametrize("replicas", [2, 3, 5])
def test_work_rotates_over_the_whole_pool(replicas):
    s = make(replicas=replicas, expected=4 * replicas)
    for r in range(replicas):
        s.request(r)
    order = []
    for sample in range(4 * replicas):
        s.ready(STAGE, [sample])
        (a,) = s.poll()
        order.append(a.replica)
        s.finish(a)
        s.request(a.replica)
    # every window of `replicas` consecutive shards reaches every replica once
    for i in range(len(order) - replicas + 1):
        assert sorted(order[i : i + replicas]) == list(range(replicas)), order


@pytest.mark.parametrize("policy", sorted(flowrl.SPLITTERS))
@pytest.mark.parametrize("interleaved", [True, False])
def test_seed_issue_first_assignments_reach_every_replica(policy, interleaved):
    replicas, prefetch = 8, 2
    s = make(replicas=replicas, policy=policy, prefetch=prefetch, batch=2, expected=16, eager=True)
    order = [r for r in range(replicas) for _ in range(prefetch)] if interleaved else list(range(replicas)) * prefetch
    for r in order:
        s.request(r)
    s.ready(STAGE, list(range(16)))
    out = s.poll()
    assert len({a.replica for a in out[:replicas]}) == replicas
    assert sorted(i for a in out for i in a.ids) == list(range(16))
    assert all(len(a.ids) <= 2 for a in out)


@pytest.mark.parametrize(
    "policy",
    [
        "guided",
        "factoring",
        "greedy",
    ],
)
def test_seed_issue_every_replica_gets_two_samples(policy):
    s = make(replicas=8, policy=policy, prefetch=2, batch=2, expected=16, eager=True)
    for r in list(range(8)) * 2:
        s.request(r)
    s.ready(STAGE, list(range(16)))
    per_replica = Counter()
    for a in s.poll():
        per_replica[a.replica] += len(a.ids)
    assert dict(per_replica) == dict.fromkeys(range(8), 16 // 8)


def test_each_sample_assigned_once_per_stage_across_stages():
    s = make(replicas=2, batch=3, expected=10, stages=("a", "b"))
    s.ready("a", list(range(10)))
    seen = Counter()
    for _ in range(100):
        for r in range(2):
            if s.in_flight[r] == 0:
                s.request(r)
        for a in s.poll():
            seen.update((a.stage, i) for i in a.ids)
            s.finish(a)
            if a.stage == "a":
                s.ready("b", a.ids)
        if s.pending == 0 and len(seen) == 20:
            break
    assert seen == Counter({(st, i): 1 for st in "ab" for i in range(10)})


def test_deepest_stage_is_served_first():
    s = make(replicas=1, prefetch=3, batch=5, expected=5, stages=("first", "middle", "last"), eager=True)
    s.ready("first", [0, 1])
    s.ready("middle", [2])
    s.ready("last", [3])
    for _ in range(3):
        s.request(0)
    assert [a.stage for a in s.poll()] == ["last", "middle", "first"]


@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_requests_beyond_prefetch_are_rejected(prefetch):
    s = make(replicas=2, prefetch=prefetch, expected=10)
    for _ in range(prefetch):
        s.request(0)
    with pytest.raises(ValueError, match="prefetch"):
        s.request(0)
    s.request(1)  # the other replica's credit is its own
    s.ready(STAGE, [0])
    (a,) = s.poll()  # a waiting slot turned into a shard in flight still counts
    with pytest.raises(ValueError, match="prefetch"):
        s.request(a.replica)
    s.finish(a)
    s.request(a.replica)


def test_ready_beyond_expected_is_rejected():
    s = make(expected=3)
    s.ready(STAGE, [0, 1])
    with pytest.raises(ValueError, match="expected"):
        s.ready(STAGE, [2, 3])
    s.ready(STAGE, [2])
    with pytest.raises(ValueError, match="expected"):
        s.ready(STAGE, [3])
    empty = make()
    with pytest.raises(ValueError):
        empty.ready(STAGE, [0])


@pytest.mark.parametrize("seed", range(5))
def test_ids_handed_out_smallest_first(seed):
    rng = random.Random(seed)
    ids = rng.sample(range(1000), 20)
    s = make(replicas=1, prefetch=1, batch=3, expected=20)
    s.ready(STAGE, ids)
    handed: list[int] = []
    while s.pending:
        s.request(0)
        (a,) = s.poll()
        assert a.ids == sorted(a.ids)
        handed += a.ids
        s.finish(a)
    assert handed == sorted(ids)


def test_withdrawn_slots_get_nothing():
    s = make(replicas=2, prefetch=2, expected=2)
    s.request(0)
    s.request(0)
    s.request(1)
    s.withdraw(0)
    s.ready(STAGE, [0, 1])
    assert [a.replica for a in s.poll()] == [1]


def simulate(replicas: int, batch: int, samples: int, policy: str, seed: str) -> None:
    rng = random.Random(seed)
    prefetch = rng.choice([1, 2, 3])
    eager = rng.random() < 0.5  # prefetch slots queue ahead, or wait until their replica is idle
    s = make(
        replicas=replicas,
        policy=policy,
        prefetch=prefetch,
        batch=batch,
        expected=samples,
        stages=("a", "b"),
        eager=eager,
    )
    arriving = list(range(samples))
    rng.shuffle(arriving)
    waiting = [0] * replicas
    running: list[list[Assignment]] = [[] for _ in range(replicas)]
    seen: Counter = Counter()
    steps = 0
    while arriving or any(running) or s.pending:
        steps += 1
        assert steps < 20 * samples + 1000, "the simulation stopped making progress"
        actions = []
        if arriving:
            actions.append("arrive")
        if free := [r for r in range(replicas) if waiting[r] + len(running[r]) < prefetch]:
            actions.append("request")
        if busy := [r for r in range(replicas) if running[r]]:
            actions.append("finish")
        action = rng.choice(actions)
        if action == "arrive":
            k = rng.randint(1, len(arriving))
            s.ready("a", arriving[:k])
            del arriving[:k]
        elif action == "request":
            r = rng.choice(free)
            s.request(r)
            waiting[r] += 1
        else:
            r = rng.choice(busy)
            done = running[r].pop(rng.randrange(len(running[r])))
            s.finish(done)
            if done.stage == "a":
                s.ready("b", done.ids)
        for a in s.poll():
            assert waiting[a.replica] > 0, "assigned to a replica that did not ask"
            assert 1 <= len(a.ids) <= batch
            waiting[a.replica] -= 1
            running[a.replica].append(a)
            seen.update((a.stage, i) for i in a.ids)
        # whenever a slot waits after poll() with samples pending, its replica has work
        # (a shard is queued ahead of the one running only when that is worth it)
        assert s.pending == 0 or all(running[r] for r in range(replicas) if waiting[r])
        assert s.in_flight == [len(x) for x in running]
    assert seen == Counter({(st, i): 1 for st in "ab" for i in range(samples)})


@pytest.mark.parametrize("policy", sorted(flowrl.SPLITTERS))
@pytest.mark.parametrize("samples", [1, 16, 97])
@pytest.mark.parametrize("batch", [1, 2, 5])
@pytest.mark.parametrize("replicas", [1, 2, 3, 7, 8])
def test_randomised_pull_simulation(replicas, batch, samples, policy):
    for run in range(2):
        simulate(replicas, batch, samples, policy, seed=f"{replicas}-{batch}-{samples}-{policy}-{run}")


def test_costliest_pending_samples_leave_first_then_the_oldest():
    s = make(replicas=1, batch=2, expected=6)
    s.ready(STAGE, [0, 1, 2], costs=[1.0, 5.0, 1.0])
    s.ready(STAGE, [3, 4, 5], costs=[5.0, 0.5, 9.0])
    order = []
    while s.pending:
        s.request(0)
        (a,) = s.poll()
        order.append(a.ids)
        s.finish(a)
    assert order == [[5, 1], [3, 0], [2, 4]]


def test_without_costs_samples_leave_oldest_first():
    s = make(replicas=1, batch=2, expected=4)
    s.ready(STAGE, [3, 1])
    s.ready(STAGE, [0, 2])
    s.request(0)
    (a,) = s.poll()
    assert a.ids == [0, 1]


@pytest.mark.parametrize("overhead_s, expected", [(0.001, [1] * 6), (0.030, [3, 3])])
def test_measured_calls_set_the_smallest_shard_worth_a_call(overhead_s, expected):
    s = make(replicas=6, policy="guided", batch=4, expected=6)
    s.measure(STAGE, 1, 0.010, overhead_s)  # 10 ms a sample against 1 ms or 30 ms outside the step
    s.ready(STAGE, list(range(6)))
    for r in range(6):
        s.request(r)
    assert sorted(len(a.ids) for a in s.poll()) == expected  # spread over six, or 3 at a time


@pytest.mark.parametrize("overhead_s, queued", [(0.001, [0]), (0.00001, [])])
def test_a_busy_replicas_second_slot_gets_a_shard_only_when_queueing_ahead_pays(overhead_s, queued):
    s = make(replicas=2, prefetch=2, expected=100)
    s.measure(STAGE, 1, 0.001, overhead_s)  # 1 ms steps; 1 ms or 10 us outside them
    s.ready(STAGE, list(range(100)))
    s.request(0)
    s.request(1)
    first = s.poll()
    assert [a.replica for a in first] == [0, 1]
    s.request(0)  # replica 0's second slot, while its first shard runs
    assert [a.replica for a in s.poll()] == queued
    s.finish(first[0])  # replica 0 idle: a slot still waiting is served at once
    assert [a.replica for a in s.poll()] == ([] if queued else [0])


@pytest.mark.parametrize("policy", sorted(flowrl.SPLITTERS))
def test_a_shard_given_back_is_cut_again_for_the_replicas_left(policy):
    s = make(replicas=3, policy=policy, batch=4, expected=12)
    s.ready(STAGE, list(range(12)))
    for r in range(3):
        s.request(r)
    shards = {a.replica: a for a in s.poll()}
    lost = shards[1]
    s.retire(1)
    s.give_back(lost)
    assert s.pending == 12 - sum(len(a.ids) for a in shards.values()) + len(lost.ids)
    with pytest.raises(ValueError, match="retired"):
        s.request(1)
    done: list[int] = []
    for r in (0, 2):
        s.finish(shards[r])
        done += shards[r].ids
    while s.pending:
        for r in (0, 2):
            s.request(r)
        got = s.poll()
        assert got and {a.replica for a in got} <= {0, 2}
        for a in got:
            s.finish(a)
            done += a.ids
    assert sorted(done) == list(range(12))  # every sample once, the lost shard's included


def test_shards_are_sized_for_the_replicas_still_serving():
    s = make(replicas=4, policy="guided", batch=100, expected=40)
    s.retire(2)
    s.retire(3)
    s.ready(STAGE, list(range(40)))
    s.request(0)
    (a,) = s.poll()
    assert len(a.ids) == 20  # half of the work for one of two replicas left, not a quarter


@pytest.mark.parametrize("policy", sorted(flowrl.SPLITTERS))
def test_samples_of_a_failed_shard_are_cut_alone_until_their_call_completes(policy):
    """A sample that makes calls hang must not take its shard's other samples down with it."""
    s = make(replicas=2, policy=policy, batch=4, expected=8)
    s.ready(STAGE, list(range(8)))
    s.request(0)
    (failed,) = s.poll()
    assert len(failed.ids) > 1
    s.give_back(failed, [0.0] * len(failed.ids))
    alone: list[Assignment] = []
    while s.pending:
        s.request(1)
        (a,) = s.poll()
        if set(a.ids) & set(failed.ids):
            assert len(a.ids) == 1, a  # a suspect never shares a call
            alone.append(a)
        s.finish(a)
    assert sorted(i for a in alone for i in a.ids) == sorted(failed.ids)
    if policy == "greedy":  # once its call completed, a sample shares calls again (its next turn)
        s.expect(STAGE, 2)
        s.ready(STAGE, failed.ids[:2])
        s.request(1)
        (a,) = s.poll()
        assert sorted(a.ids) == sorted(failed.ids[:2])


def test_a_dropped_sample_is_no_longer_expected_nor_waited_for():
    s = make(replicas=1, policy="cost", batch=4, expected=4)
    s.admit(STAGE, 4)
    s.ready(STAGE, [0, 1, 2, 3])
    s.request(0)
    (a,) = s.poll()
    assert a.ids == [0, 1, 2, 3]
    s.give_back(a, [0.0] * 3, dropped=[0])
    assert s.pending == 3
    done = []
    while s.pending:
        s.request(0)
        (b,) = s.poll()
        s.finish(b)
        done += b.ids
    assert sorted(done) == [1, 2, 3]
    s.request(0)
    assert s.poll() == [] and s.pending == 0
    q = s._stages[STAGE]
    assert q.remaining == 0 and q.coming == 0  # the stage no longer counts on the dropped sample


def test_a_dropped_sample_is_no_suspect_and_a_resume_forgets_them_all():
    s = make(replicas=1, policy="greedy", batch=4, expected=4)
    s.ready(STAGE, [0, 1, 2, 3])
    s.request(0)
    (a,) = s.poll()
    s.give_back(a, [0.0] * 4)  # the call hung: every sample a suspect
    s.request(0)
    (b,) = s.poll()
    assert len(b.ids) == 1
    s.give_back(b, [], dropped=b.ids)  # hung again: dropped
    assert b.ids[0] not in s._stages[STAGE].suspects
    s.forget_suspects()  # ids start again (a resume): the others are cut together
    s.request(0)
    (c,) = s.poll()
    assert sorted(c.ids) == sorted(set(a.ids) - set(b.ids))


def test_a_suspect_goes_to_an_idle_replica_and_nothing_queues_behind_it():
    s = make(replicas=2, policy="greedy", batch=4, prefetch=2, expected=8)
    s.ready(STAGE, list(range(8)))
    s.request(0)
    (a,) = s.poll()
    s.give_back(a, [0.0] * len(a.ids))  # suspects now
    s.request(0)
    s.request(0)
    s.request(1)
    got = s.poll()
    # each idle replica takes one suspect, alone; replica 0's second slot gets nothing behind it
    assert sorted(x.replica for x in got) == [0, 1]
    assert all(len(x.ids) == 1 and x.ids[0] in a.ids for x in got)
    s.finish(next(x for x in got if x.replica == 1))
    s.request(1)
    (more,) = s.poll()  # replica 1 idle again: the next suspect; replica 0 still runs its own
    assert more.replica == 1 and len(more.ids) == 1
