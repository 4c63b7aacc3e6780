"""The length memory, several epochs on the simulator, and static push on the simulator's clock."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

import flowrl
from flowrl._core.scheduling.lengths import LengthMemory, length_of
from flowrl._sim.epochs import simulate_epochs
from flowrl._sim.push import simulate_push
from flowrl._sim.simulate import simulate, tails
from flowrl._tools.scenarios import scenarios


def test_a_prompts_samples_in_one_rollout_count_once_then_rollouts_are_averaged():
    memory = LengthMemory(weight=0.25)
    memory.observe([7, 7, 3], [10.0, 30.0, 5.0])  # prompt 7's group: mean 20
    assert memory.predict(7) == 20.0 and memory.predict(3) == 5.0
    memory.observe([7], [40.0])
    assert memory.predict(7) == 30.0  # the mean of its two rollouts
    memory.observe([7], [60.0])
    assert memory.predict(7) == 40.0  # the mean of three
    memory.observe([7], [60.0])
    assert memory.predict(7) == 45.0  # four seen: from now on the latest weighs a quarter
    memory.observe([7], [60.0])
    assert memory.predict(7) == 48.75
    assert memory.predict(99) is None


def test_unseen_prompts_get_the_mean_of_the_seen_and_nothing_seen_gives_zeros():
    memory = LengthMemory()
    assert memory.costs([1, 2]) == [0.0, 0.0]  # no history: the stages keep their oldest-first order
    memory.observe([1, 2], [10.0, 30.0])
    assert memory.costs([2, 5, 1]) == [30.0, 20.0, 10.0]


def test_the_state_round_trips_and_a_bad_row_is_refused():
    memory = LengthMemory()
    memory.observe([4, 9, 9], [3.0, 8.0, 10.0])
    again = LengthMemory()
    again.restore(msgspec.json.decode(msgspec.json.encode(memory.state())))
    assert again.costs([4, 9, 1]) == memory.costs([4, 9, 1])
    for row in ([1.5, 3.0, 1.0], [-1, 3.0, 1.0], [2, float("nan"), 1.0], [2, 3.0, 0.0]):
        with pytest.raises(flowrl.ConfigError, match="prompt length row"):
            LengthMemory().restore([row])


@pytest.mark.parametrize(
    "value, length",
    [(12, 12.0), (2.5, 2.5), (np.int64(4), 4.0), ([1, 2, 3], 3.0), (np.zeros(5), 5.0), ((), 0.0)],
)
def test_a_length_is_a_number_or_a_sequences_len(value, length):
    assert length_of(value, "here") == length


@pytest.mark.parametrize("value", ["text", True, -1, float("inf"), None, {"a": 1}])
def test_what_is_not_a_length_is_refused_naming_where(value):
    with pytest.raises(flowrl.ConfigError, match="^here: "):
        length_of(value, "here")


def test_a_prompts_time_repeats_across_epochs_but_for_the_noise():
    w = scenarios()["heavy-tail-epochs"]
    first = tails(w)["policy"]
    later = tails(msgspec.structs.replace(w, epoch=1))["policy"]
    assert not np.array_equal(first, later)
    assert np.corrcoef(np.log(first), np.log(later))[0, 1] > 0.9  # sigma 1.2 across prompts, 0.3 noise
    grouped = tails(msgspec.structs.replace(w, epoch_noise=0.0))["policy"].reshape(-1, w.group)
    assert (grouped == grouped[:, :1]).all()  # a group's samples share their prompt's time


def test_with_a_memory_the_later_epochs_come_within_a_quarter_of_the_bound():
    w = scenarios()["heavy-tail-epochs"]
    remembered = simulate_epochs(w, 3)
    oblivious = simulate_epochs(w, 3, remember=False)
    assert remembered[0].makespan_s == oblivious[0].makespan_s  # no history yet: the same schedule
    for r, o in zip(remembered[1:], oblivious[1:], strict=True):
        assert r.ratio <= 1.25 < o.ratio


def test_simulate_refuses_costs_of_the_wrong_length():
    w = scenarios()["prime-97"]
    with pytest.raises(flowrl.ConfigError, match=r"one cost per sample \(97\)"):
        simulate(w, costs=[1.0] * 3)


def test_push_on_the_209_layout_uses_half_the_scorer_replicas_in_batch_sized_calls():
    w = scenarios()["chatlearn-209"]
    push = simulate_push(w)
    for stage in ("reference", "value", "reward"):
        assert push.replicas_used[stage] == 4  # 4 policy batches, each whole to one replica
        assert push.shard_sizes[stage] == {4: 4}  # each batch of 4 in one call (two steps of 2)
    assert push.makespan_s >= push.lower_bound_s
    assert simulate(w).makespan_s < push.makespan_s  # pull uses the idle half


def test_push_serves_a_replicas_batches_one_after_another():
    w = scenarios()["tiny-shards"]
    push = simulate_push(w)
    busy = sum(sum(b) for b in push.busy_s.values())
    # 4 replicas per stage: the makespan is at least each replica's share of the work
    assert push.makespan_s >= busy / 8 * 0.999
