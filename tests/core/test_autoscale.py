"""Elastic pools, sans-IO: the scheduler serving an added replica and retiring one, the
autoscaling policy within its limits, and the autoscale settings."""

from __future__ import annotations

import pytest

import flowrl
from flowrl._core.observe.pipeline_stats import StatsRecorder
from flowrl._core.scheduling.autoscale import AutoscalePolicy, Reading
from flowrl._core.scheduling.scheduler import PoolScheduler
from flowrl._core.settings.config import CallMeta

STAGE = "m.forward_step"


def test_an_added_replica_is_served_first_and_a_retired_one_finishes_its_shard():
    s = PoolScheduler(replicas=2, policy="greedy")
    s.add_stage(STAGE, 1)
    s.expect(STAGE, 4)
    s.ready(STAGE, [0, 1, 2, 3])
    s.request(0)
    (a,) = s.poll()
    assert s.add_replica() == 2 and s.serving == 3
    s.request(1)
    s.request(2)
    assert [x.replica for x in s.poll()] == [2, 1]  # never served: first
    s.retire(0)  # removed while its shard runs: no new shard, the one it holds finishes
    s.finish(a)
    with pytest.raises(ValueError, match="retired"):
        s.request(0)
    assert s.serving == 2 and s.in_flight[0] == 0


def reading(serving=2, queued=0, starved=0.0, batch=2, model="m"):
    return Reading(model=model, serving=serving, queued=queued, starved=starved, batch_size=batch, cpus=1.0)


def policy(**cfg):
    return AutoscalePolicy({"m": flowrl.Autoscale(**{"max_replicas": 6, "patience": 2, **cfg})})


@pytest.mark.parametrize("queued, room, after", [(8, 10, 4), (40, 10, 6), (40, 1, 3), (5, 10, 3), (40, 0, None)])
def test_a_long_queue_grows_the_pool_after_patience_within_max_and_room(queued, room, after):
    p = policy()
    free = {"CPU": float(room)}  # a replica asks for 1 CPU
    assert p.decide([reading(queued=queued)], free) == []  # one reading is not enough
    events = p.decide([reading(queued=queued)], free)
    if after is None:
        assert events == []  # no room: nothing to do
        return
    (event,) = events
    assert (event.action, event.before, event.after) == ("grow", 2, after)
    assert "grow_queue" in event.reason and event.reading.queued == queued


@pytest.mark.parametrize(
    "serving, starved, minimum, after",
    [(6, 0.9, 1, 1), (6, 0.5, 1, 3), (6, 0.9, 2, 2), (2, 0.9, 2, None), (4, 0.3, 1, None), (3, 0.6, 1, 2)],
)
def test_a_starved_pool_shrinks_to_the_work_it_did_but_not_below_min(serving, starved, minimum, after):
    p = policy(min_replicas=minimum)
    for _ in range(3):
        events = p.decide([reading(serving=serving, starved=starved)], {})
        if events:
            break
    if after is None:
        assert events == []
    else:
        assert [(e.action, e.after) for e in events] == [("shrink", after)]


def test_readings_must_come_in_a_row():
    p = policy(patience=3)
    for r in (reading(queued=20), reading(queued=20), reading(), reading(queued=20), reading(queued=20)):
        assert p.decide([r], {"CPU": 8}) == []
    p.reset()
    assert p.decide([reading(queued=20)], {"CPU": 8}) == []


def test_what_a_shrink_frees_is_there_for_a_grow_in_the_same_tick():
    p = AutoscalePolicy({m: flowrl.Autoscale(max_replicas=5, patience=1) for m in ("a", "b")})
    events = p.decide(
        [reading(model="a", serving=3, queued=40), reading(model="b", serving=3, starved=0.7)], {"CPU": 0.0}
    )
    assert [(e.model, e.action, e.before, e.after) for e in events] == [("b", "shrink", 3, 1), ("a", "grow", 3, 5)]


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"max_replicas": 2, "min_replicas": 3}, "below min_replicas"),
        ({"max_replicas": 2, "shrink_starved": 1.5}, "shrink_starved"),
        ({"max_replicas": 0}, "max_replicas must be > 0"),
    ],
)
def test_bad_autoscale_settings_are_named(bad, message):
    with pytest.raises(flowrl.ConfigError, match=message):
        flowrl.Autoscale(**bad)


def test_a_start_count_outside_the_autoscale_limits_is_refused():
    with pytest.raises(flowrl.ConfigError, match=r"5 replicas to start with, outside autoscale's \[min_replicas=1"):
        flowrl.ModelConfig(num_replicas=5, autoscale={"max_replicas": 4})


def test_a_joining_replica_holds_its_id_but_is_not_served_until_it_joins():
    s = PoolScheduler(replicas=1, policy="greedy")
    s.add_stage(STAGE, 1)
    s.expect(STAGE, 4)
    s.ready(STAGE, [0, 1, 2, 3])
    a, b = s.add_replica(joining=True), s.add_replica(joining=True)  # two replacements start side by side
    assert (a, b) == (1, 2) and s.serving == 1 and s.serving_ids() == [0]
    with pytest.raises(ValueError, match="not joined"):
        s.request(a)
    s.join(b)  # the later one is ready first
    assert s.serving == 2 and s.serving_ids() == [0, 2]
    s.request(b)
    assert [x.replica for x in s.poll()] == [b]
    s.retire(a)  # its start failed: it never served, and its id stays taken
    assert s.joining == set() and s.serving_ids() == [0, 2] and s.add_replica() == 3


def test_a_replica_that_joins_before_a_lower_id_leaves_that_one_empty_until_it_joins():
    rec = StatsRecorder({STAGE: "m"}, {"m": 1})
    rec.add_active(10.0)
    rec.add_replica("m", 2, 10.0)  # replica 1 is still starting
    rec.record(STAGE, 2, CallMeta(rows=3, fields=["x"], busy_s=1.0), 1.0)
    rec.add_active(4.0)
    reps = {r.replica: r for r in rec.snapshot().stages[STAGE].replicas}
    assert sorted(reps) == [0, 1, 2]
    assert (reps[1].samples, reps[1].idle_s) == (0, 0.0)  # not in the pool: no idle time either
    assert (reps[2].samples, reps[2].idle_s) == (3, 3.0)  # 4 s in the pool, 1 s busy
    rec.add_replica("m", 1, 14.0)
    rec.add_active(2.0)
    reps = {r.replica: r for r in rec.snapshot().stages[STAGE].replicas}
    assert (reps[1].idle_s, reps[2].idle_s) == (2.0, 5.0)
