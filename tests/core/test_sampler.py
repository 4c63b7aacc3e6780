"""Episode sampler, relay buffer and train-step planning (sans-IO)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

import flowrl
from flowrl._core.training.sampler import EpisodeBuffer, EpisodeSampler, RelayBuffer, plan_steps


def test_episodes_draw_consecutive_prompts_and_wrap_around():
    s = EpisodeSampler(dataset_size=5, samples_per_episode=3)
    drawn = [[p for p, _ in s.next_episode()] for _ in range(4)]
    assert drawn == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]
    assert s.position == 12  # a later learn() continues from here


@pytest.mark.parametrize("seed", [0, 7])
def test_shuffle_is_a_seeded_permutation_of_each_pass(seed):
    a = EpisodeSampler(dataset_size=10, samples_per_episode=5, shuffle=True, seed=seed)
    b = EpisodeSampler(dataset_size=10, samples_per_episode=5, shuffle=True, seed=seed)
    first = [p for _ in range(4) for p, _ in a.next_episode()]
    assert first == [p for _ in range(4) for p, _ in b.next_episode()]  # reproducible
    assert sorted(first[:10]) == list(range(10)) and sorted(first[10:]) == list(range(10))
    assert first[:10] != first[10:]  # each pass has its own order


def test_groups_of_n_copies_stay_together():
    s = EpisodeSampler(dataset_size=3, samples_per_episode=6, n=3)
    assert s.next_episode() == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    with pytest.raises(flowrl.ConfigError, match="num_samples_per_prompt=4.*e.g. 4 or 8"):
        EpisodeSampler(dataset_size=3, samples_per_episode=6, n=4)


@pytest.mark.parametrize("keep, expected", [(0, [3]), (1, [3]), (2, [2, 3]), (-1, [0, 1, 2, 3])])
def test_relay_buffer_keeps_the_last_episodes(keep, expected):
    relay = RelayBuffer(keep)
    for e in range(4):
        relay.add(EpisodeBuffer(e, [e]))
    assert [ep.episode_id for ep in relay.episodes] == expected


GRID = list(itertools.product([1, 7, 16, 33], [1, 4, 5, 16], [1, 2, 3], [1, 2, 4], [1, 2]))


@pytest.mark.parametrize("num, gbs, dp, micro, group", GRID)
def test_every_row_is_trained_once_per_epoch_in_order(num, gbs, dp, micro, group):
    if gbs % group:
        with pytest.raises(flowrl.ConfigError, match="whole number of groups.*use e.g."):
            plan_steps(num, global_batch=gbs, micro_batch=micro, dp=dp, group=group)
        return
    steps = plan_steps(num, global_batch=gbs, micro_batch=micro, dp=dp, group=group)
    rows = [r for st in steps for rank in st.ranks for mb in rank for r in mb]
    assert rows == list(range(num))  # exactly once, in dataset order
    for st in steps:
        assert st.size == sum(len(mb) for rank in st.ranks for mb in rank) <= gbs
        assert len(st.ranks) == dp
        sizes = [sum(len(mb) for mb in rank) for rank in st.ranks]
        assert max(sizes) - min(sizes) <= 2 * group - 1  # near-equal: one group apart (last may be short)
        assert all(len(mb) <= micro for rank in st.ranks for mb in rank)
        # a group never straddles two ranks
        owners = Counter((r // group, i) for i, rank in enumerate(st.ranks) for mb in rank for r in mb)
        assert len({g for g, _ in owners}) == len(owners)
    full = num // (gbs // group * group)
    assert len(steps) == full + (num % (gbs // group * group) > 0)


def test_groups_follow_prompt_keys_when_a_relay_drops_or_reorders_samples():
    keys = [7, 7, 7, 3, 3, 9, 9, 9, 4]  # a relay dropped one copy of prompt 3 and two of prompt 4
    steps = plan_steps(len(keys), global_batch=6, micro_batch=6, dp=2, group=3, keys=keys)
    for st in steps:
        for rank in st.ranks:
            rows = [r for mb in rank for r in mb]
            # a prompt's copies are never split over ranks or steps
            assert all(
                keys[r] not in {keys[x] for other in st.ranks if other is not rank for mb in other for x in mb}
                for r in rows
            )
    assert [r for st in steps for rank in st.ranks for mb in rank for r in mb] == list(range(len(keys)))
