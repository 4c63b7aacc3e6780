"""The replacement policy of a pool (``Healing``): rows per line of replicas, the per-minute
bound and the backoff, as plain function calls."""

from __future__ import annotations

import pytest

from flowrl import ConfigError
from flowrl._core.scheduling.restarts import RestartPolicy
from flowrl._core.settings.healing import Healing


def policy(**healing: float) -> RestartPolicy:
    return RestartPolicy("gen", Healing(**healing))  # type: ignore[arg-type]


def test_a_line_that_keeps_dying_is_replaced_with_growing_waits_then_left_out() -> None:
    p = policy(max_restarts=3, backoff_s=1.0, max_backoff_s=30.0)
    delays, replica = [], 0
    for new in (5, 6, 7):  # each replacement dies in turn, before it completes a shard
        answer = p.died(replica, now=float(new))
        delays.append(answer.delay_s)
        p.replaced(replica, new)
        replica = new
    assert delays == [0.0, 1.0, 2.0]  # the first at once, then doubling
    last = p.died(replica, now=10.0)
    assert last.delay_s is None
    assert last.reason == "replica 7 of 'gen' died after 3 replacements in a row (Healing.max_restarts=3): left out"


def test_a_replacement_that_completes_a_shard_ends_the_row() -> None:
    p = policy(max_restarts=1)
    assert p.died(0, now=0.0).delay_s == 0.0
    p.replaced(0, 4)
    p.served(4)
    assert p.died(4, now=100.0).delay_s == 0.0  # a fresh row: replaced again, at once


def test_a_replacement_that_fails_to_start_is_tried_again_within_the_same_row() -> None:
    p = policy(max_restarts=2, backoff_s=1.0)
    assert p.died(0, now=0.0).delay_s == 0.0
    assert p.start_failed(0, now=1.0).delay_s == 1.0  # its start failed: the second of the row, after a wait
    last = p.start_failed(0, now=2.0)
    assert last.delay_s is None and "after 2 replacements in a row (Healing.max_restarts=2)" in last.reason


def test_other_replicas_have_rows_of_their_own() -> None:
    p = policy(max_restarts=1)
    assert p.died(0, now=0.0).delay_s == 0.0
    p.replaced(0, 4)
    assert p.died(4, now=1.0).delay_s is None  # line 0 spent its one
    assert p.died(1, now=2.0).delay_s == 0.0  # line 1 has not


@pytest.mark.parametrize(("now", "replaced"), [(59.9, False), (60.0, True)])
def test_at_most_per_minute_replacements_start_within_any_60_s(now: float, replaced: bool) -> None:
    p = policy(per_minute=2)
    assert p.died(0, now=0.0).delay_s == 0.0
    assert p.died(1, now=30.0).delay_s == 0.0
    answer = p.died(2, now=now)  # the first left the window at 60 s
    assert (answer.delay_s is not None) == replaced
    if not replaced:
        assert "2 replacements in the last 60 s already (Healing.per_minute=2): left out" in answer.reason


def test_the_backoff_stops_growing_at_its_cap() -> None:
    p = policy(max_restarts=10, backoff_s=4.0, max_backoff_s=10.0)
    replica, delays = 0, []
    for new in range(1, 6):
        delays.append(p.died(replica, now=float(new) * 100).delay_s)
        p.replaced(replica, new)
        replica = new
    assert delays == [0.0, 4.0, 8.0, 10.0, 10.0]


def test_without_healing_nothing_is_replaced() -> None:
    answer = RestartPolicy("gen", None).died(3, now=0.0)
    assert answer.delay_s is None and answer.reason == "replica 3 of 'gen' died; ModelConfig.healing is off"


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"per_minute": 0}, "Healing.per_minute must be > 0"),
        ({"max_restarts": -1}, "Healing.max_restarts must be >= 0"),
        ({"backoff_s": 5.0, "max_backoff_s": 1.0}, "Healing.max_backoff_s=1.0 is below backoff_s=5.0"),
        ({"every": 1}, "Healing: Unexpected keyword argument 'every'"),
    ],
)
def test_settings_that_cannot_work_are_refused(settings: dict[str, float], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        Healing(**settings)  # type: ignore[arg-type]
