"""The multi-turn simulator (sans-IO): every turn and segment is simulated once, no mode beats
the strict lower bound, and one sample alone takes exactly its own path."""

from __future__ import annotations

import math

import pytest

from flowrl._sim.turns import MODES, Turn, TurnWorkload, heavy_tailed, lower_bound, simulate_turns


def workload(seed: int, replicas: tuple[int, int], batch: tuple[int, int], budget: int) -> TurnWorkload:
    samples = heavy_tailed(
        23, mean_turns=3, max_turns=9, mean_tokens=50, sigma=1.0, mean_env_s=0.01, env_sigma=0.8, seed=seed
    )
    return TurnWorkload(
        samples,
        policy_replicas=replicas[0],
        batch=batch[0],
        env_replicas=replicas[1],
        env_batch=batch[1],
        fixed_s=0.005,
        token_s=0.0002,
        env_fixed_s=0.001,
        budget=budget,
    )


LAYOUTS = [(s, r, b, k) for s in (1, 2) for r in ((1, 1), (3, 2)) for b in ((1, 1), (4, 3)) for k in (0, 16)]


@pytest.mark.parametrize("seed, replicas, batch, budget", LAYOUTS)
def test_every_turn_once_and_never_below_the_bound(seed, replicas, batch, budget):
    w = workload(seed, replicas, batch, budget)
    bound = lower_bound(w)
    turns = sum(len(s) for s in w.samples)
    for mode in MODES:
        result = simulate_turns(w, mode)
        assert result.makespan_s >= bound * (1 - 1e-9), mode
        assert result.turns == [len(s) for s in w.samples]
        if mode == "partial" and budget:
            assert result.segments == sum(math.ceil(t.tokens / budget) for s in w.samples for t in s)
        else:
            assert result.segments == turns  # one generation per turn of each sample
        assert result.policy_calls >= math.ceil(result.segments / batch[0])


def test_one_sample_alone_takes_its_own_path_in_every_mode():
    sample = (Turn(10, 0.5), Turn(30, 0.25), Turn(5, 1.0))
    w = TurnWorkload((sample,), 2, 4, 2, 4, fixed_s=0.1, token_s=0.01, env_fixed_s=0.05)
    path = sum(0.1 + 0.01 * t.tokens + 0.05 + t.env_s for t in sample)
    assert lower_bound(w) == pytest.approx(path)
    for mode in ("whole", "turn"):
        assert simulate_turns(w, mode).makespan_s == pytest.approx(path)


def test_a_budget_splits_a_generation_into_segments_that_each_pass_the_environment():
    w = TurnWorkload(((Turn(10, 0.5),),), 1, 1, 1, 1, fixed_s=0.1, token_s=0.01, env_fixed_s=0.05, budget=4)
    result = simulate_turns(w, "partial")
    assert (result.policy_calls, result.env_calls, result.segments) == (3, 3, 3)
    # three calls of 4, 4 and 2 tokens; the environment skips the first two segments
    assert result.makespan_s == pytest.approx(3 * 0.1 + 0.01 * 10 + 3 * 0.05 + 0.5)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        simulate_turns(workload(1, (1, 1), (1, 1), 0), "batch")
