"""The staleness gate of asynchronous training, sans-IO: how far rollouts may run ahead of
training, the lag histogram, and the settings."""

from __future__ import annotations

import pytest

import flowrl
from flowrl._core.training.staleness import histogram, lags, rollout_needs, too_stale, train_version


@pytest.mark.parametrize("slack", [0, 1])
@pytest.mark.parametrize("sync_every", [1, 2, 3])
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_the_gate_keeps_every_episode_within_the_bound_and_waits_no_longer(k, sync_every, slack):
    for e in range(40):
        needed = rollout_needs(e, max_staleness=k, sync_every=sync_every, slack=slack)
        # once `needed` episodes are trained and synced, replicas hold version needed // sync_every
        assert train_version(e, sync_every) - train_version(needed, sync_every) <= k + slack
        if needed:  # one episode fewer would break the bound
            assert train_version(e, sync_every) - train_version(needed - 1, sync_every) > k + slack
        assert needed <= e  # never waits for its own training


@pytest.mark.parametrize(
    "e, k, s, needed",
    [(5, 0, 1, 5), (5, 1, 1, 4), (1, 0, 2, 0), (2, 0, 2, 2), (5, 1, 2, 2), (7, 2, 1, 5), (0, 0, 1, 0)],
)
def test_rollout_needs_examples(e, k, s, needed):
    assert rollout_needs(e, max_staleness=k, sync_every=s) == needed


def test_lags_histogram_and_too_stale():
    samples = [{"p_version": 3, "v_version": 1}, {"p_version": 1}, {"x": 0}]
    versions = {"p": 3, "v": 2}
    assert lags(samples[0], versions) == {"p": 0, "v": 1} and lags(samples[2], versions) == {}
    assert histogram(samples, versions) == {"p": {0: 1, 2: 1}, "v": {1: 1}}
    assert too_stale(samples, versions, 0) == [0, 1] and too_stale(samples, versions, 1) == [1]
    assert too_stale(samples, versions, 2) == []


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"staleness": {"max": -1}}, r"RunConfig\.staleness\.max must be >= 0"),
        ({"staleness": {"on_stale": "skip"}}, r"RunConfig\.staleness\.on_stale must be one of"),
    ],
)
def test_bad_async_settings_are_named(bad, message):
    with pytest.raises(flowrl.ConfigError, match=message):
        flowrl.RunConfig(sample_per_episode=8, **bad)
