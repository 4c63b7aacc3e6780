"""BusyClock: overlapping calls are charged the union of their time, once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowrl._core.scheduling.overlap import BusyClock, merged


def union_length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged(spans))


@pytest.mark.parametrize(
    ("calls", "order", "charged"),
    [
        ([(0, 4)], [0], [4]),  # alone: its whole time
        ([(0, 4), (5, 7)], [0, 1], [4, 2]),  # apart: each its own
        ([(0, 4), (2, 6)], [0, 1], [4, 2]),  # the second overlaps the first's end
        ([(0, 6), (2, 4)], [1, 0], [2, 4]),  # inside the first, ending first
        ([(0, 2), (1, 5), (3, 4)], [0, 2, 1], [2, 1, 2]),
    ],
)
def test_each_call_is_charged_what_no_call_was_charged_before(
    calls: list[tuple[float, float]], order: list[int], charged: list[float]
) -> None:
    clock = BusyClock()
    starts = sorted(range(len(calls)), key=lambda i: calls[i][0])
    tokens = {i: clock.begin(calls[i][0]) for i in starts}
    got = {i: clock.end(tokens[i], calls[i][1]) for i in order}
    assert [got[i] for i in order] == pytest.approx(charged)


@st.composite
def schedules(draw: st.DrawFn) -> list[tuple[str, int, float]]:
    """Events of calls that start in time order and end in any order after they start."""
    n = draw(st.integers(1, 8))
    starts = sorted(draw(st.lists(st.floats(0, 100), min_size=n, max_size=n)))
    lengths = draw(st.lists(st.floats(0, 50), min_size=n, max_size=n))
    events = [(s, 0, "begin", i) for i, s in enumerate(starts)]
    events += [(s + d, 1, "end", i) for i, (s, d) in enumerate(zip(starts, lengths, strict=True))]
    return [(kind, i, at) for at, _, kind, i in sorted(events)]


@given(schedules())
def test_the_charges_add_up_to_the_union_of_the_calls_time(events: list[tuple[str, int, float]]) -> None:
    clock, tokens, spans, start = BusyClock(), {}, [], {}
    total = 0.0
    for kind, i, at in events:
        if kind == "begin":
            tokens[i], start[i] = clock.begin(at), at
        else:
            charge = clock.end(tokens[i], at)
            assert charge >= -1e-9
            total += charge
            spans.append((start[i], at))
    assert total == pytest.approx(union_length(spans), abs=1e-6)
