"""The one lower-bound rule of the simulators (``flowrl._sim.bound``)."""

from __future__ import annotations

import pytest

from flowrl._sim.bound import makespan_floor


@pytest.mark.parametrize(
    ("paths", "pools", "floor"),
    [
        ([1.0, 3.0, 2.0], [(4.0, 4), (6.0, 3)], 3.0),  # the slowest sample's own way
        ([1.0], [(4.0, 4), (12.0, 3)], 4.0),  # the busiest pool's work over its replicas
        ([], [(5.0, 2)], 2.5),
        ([0.5], [], 0.5),
        ([], [], 0.0),
    ],
)
def test_no_schedule_ends_before_the_slowest_path_or_the_busiest_pool(paths, pools, floor):
    assert makespan_floor(paths, pools) == pytest.approx(floor)
