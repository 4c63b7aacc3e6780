"""PoolScheduler in deterministic mode: shards are fixed blocks of sample ids, whatever the
replica counts, the splitter, prefetch and the order in which samples become ready or finish."""

from __future__ import annotations

import random

import pytest

from flowrl._core.scheduling.scheduler import Assignment, PoolScheduler

A, B = "m.first", "m.second"


def make(replicas=2, policy="cost", prefetch=2, sizes=((A, 4),), expected=0):
    s = PoolScheduler(replicas=replicas, policy=policy, prefetch=prefetch, deterministic=True)
    for name, batch in sizes:
        s.add_stage(name, batch)
        s.expect(name, expected)
        s.admit(name, expected)
    return s


def places(ids, run=0, first=0):
    return [(run, i - first) for i in ids]


def drive(s, runs, seed, stages):
    """Admit the runs' samples ((first id, count) each) in random chunks, finish shards in a
    random order (a finished shard's samples become ready for the next stage, shuffled), serve
    every slot; the shards cut, per stage."""
    rng = random.Random(seed)
    cut: dict[str, list[tuple[int, ...]]] = {name: [] for name in stages}
    place = {i: (run, i - first) for run, (first, n) in enumerate(runs) for i in range(first, first + n)}
    admit = [list(range(first, first + n)) for first, n in runs]
    running: list[Assignment] = []
    for r in range(s.replicas):
        for _ in range(s.prefetch):
            s.request(r)
    while admit or running:
        if admit and (not running or rng.random() < 0.5):
            k = rng.randint(1, 5)
            ids, admit[0] = admit[0][:k], admit[0][k:]
            s.ready(stages[0], ids, places=[place[i] for i in ids])
            if not admit[0]:
                run = len(runs) - len(admit)
                admit.pop(0)
                s.seal(run, runs[run][1])
        else:
            a = running.pop(rng.randrange(len(running)))
            s.finish(a)
            s.request(a.replica)
            nxt = stages.index(a.stage) + 1
            if nxt < len(stages):
                ids = list(a.ids)
                rng.shuffle(ids)
                s.ready(stages[nxt], ids, places=[place[i] for i in ids])
        for a in s.poll():
            running.append(a)
            cut[a.stage].append(tuple(a.ids))
    assert s.pending == 0, "samples left pending with every slot idle"
    return {name: sorted(shards) for name, shards in cut.items()}


def blocks(first, n, batch):
    return [tuple(range(b, min(b + batch, first + n))) for b in range(first, first + n, batch)]


@pytest.mark.parametrize("policy", ["cost", "guided", "factoring", "greedy"])
@pytest.mark.parametrize(("replicas", "prefetch"), [(1, 1), (3, 2), (8, 2)])
@pytest.mark.parametrize("seed", range(4))
def test_shards_are_the_blocks_of_each_run_whatever_the_layout(policy, replicas, prefetch, seed):
    runs = [(0, 23), (23, 9), (32, 3)]  # the last blocks of each run are shorter
    s = make(replicas, policy, prefetch, sizes=((A, 4), (B, 3)), expected=35)
    cut = drive(s, runs, seed, [A, B])
    assert cut[A] == sorted(b for first, n in runs for b in blocks(first, n, 4))
    assert cut[B] == sorted(b for first, n in runs for b in blocks(first, n, 3))


def test_a_block_waits_for_every_member():
    s = make(replicas=2, sizes=((A, 4),), expected=8)
    s.request(0)
    s.request(1)
    s.ready(A, [0, 1, 2, 5], places=places([0, 1, 2, 5]))
    assert s.poll() == []  # block 0 lacks sample 3, block 1 has only 5
    assert s.pending == 0
    s.ready(A, [3], places=places([3]))
    assert s.poll() == [Assignment(0, A, [0, 1, 2, 3])]
    s.ready(A, [7, 4, 6], places=places([7, 4, 6]))
    assert s.poll() == [Assignment(1, A, [4, 5, 6, 7])]  # in id order


def test_the_last_short_block_waits_for_the_run_to_be_sealed():
    s = make(replicas=1, sizes=((A, 4),), expected=6)
    s.request(0)
    s.ready(A, list(range(6)), places=places(range(6)))
    (a,) = s.poll()
    assert a == Assignment(0, A, [0, 1, 2, 3])
    s.finish(a)
    s.request(0)
    assert s.poll() == []  # 4 and 5 may have company still
    s.seal(0, 6)
    assert s.poll() == [Assignment(0, A, [4, 5])]


def test_a_seal_before_the_members_arrive_sizes_the_block():
    s = make(replicas=1, sizes=((A, 4),), expected=2)
    s.seal(0, 2)
    s.request(0)
    s.ready(A, [0], places=places([0]))
    assert s.poll() == []
    s.ready(A, [1], places=places([1]))
    assert s.poll() == [Assignment(0, A, [0, 1])]


def test_runs_never_share_a_block():
    s = make(replicas=1, sizes=((A, 4),), expected=4)
    s.request(0)
    s.ready(A, [0, 1], places=places([0, 1], run=0))
    s.ready(A, [2, 3], places=places([2, 3], run=1, first=2))
    assert s.poll() == []
    s.seal(1, 2)
    assert s.poll() == [Assignment(0, A, [2, 3])]


def test_without_places_each_sample_is_a_block_of_its_own():
    s = make(replicas=1, prefetch=2, sizes=((A, 4),), expected=3)
    s.request(0)
    s.request(0)
    s.measure(A, 1, 0.001, 0.001)  # calls measured with overhead: a second slot queues ahead
    s.ready(A, [2, 0, 1])
    assert [a.ids for a in s.poll()] == [[2], [0]]


def test_a_shard_given_back_comes_back_whole_then_its_samples_alone():
    s = make(replicas=2, prefetch=1, sizes=((A, 3),), expected=3)
    s.request(0)
    s.request(1)
    s.ready(A, [0, 1, 2], places=places([0, 1, 2]))
    (a,) = s.poll()
    s.give_back(a)  # the replica died: the block goes back whole
    (b,) = s.poll()
    assert sorted(b.ids) == [0, 1, 2] and b.replica != a.replica
    s.give_back(b)  # once more: each sample is a suspect, cut alone, to an idle replica
    s.request(a.replica)
    s.request(b.replica)
    shards = s.poll()
    assert [x.ids for x in shards] == [[0], [1]]
    s.finish(shards[0])
    s.request(shards[0].replica)
    assert [x.ids for x in s.poll()] == [[2]]


def test_a_resume_forgets_the_runs_sealed():
    s = make(replicas=1, sizes=((A, 4),), expected=4)
    s.seal(0, 2)
    s.forget_suspects()  # run numbers start again
    s.request(0)
    s.ready(A, [0, 1], places=places([0, 1]))
    assert s.poll() == []  # run 0 is a new run: its size is not known yet


def test_more_ready_than_expected_counts_the_parked_samples():
    s = make(replicas=1, sizes=((A, 4),), expected=2)
    s.ready(A, [0, 1], places=places([0, 1]))
    with pytest.raises(ValueError, match="more samples ready than expected"):
        s.ready(A, [2], places=places([2]))
