"""A smoke run of the load-test harness (benchmarks are not tests: no timing is asserted)."""

from __future__ import annotations

import asyncio

import pytest

from flowrl._tools.baselines import run_push
from flowrl._tools.cli import main as cli
from flowrl._tools.loadtest import median_row, run_flowrl, scenarios
from flowrl.testing import flowrl_actor_names


@pytest.mark.slow  # ~45 s: a load-test run; the seed scenario's counts are checked by tests/pipeline
def test_on_the_209_scenario_flowrl_uses_every_replica_and_static_push_half(ray_cluster):
    w = scenarios()["chatlearn-209"]
    (flow,) = asyncio.run(run_flowrl(w))
    push = asyncio.run(run_push(w))
    for stage in ("reference", "value", "reward"):
        assert flow["replicas_used"][stage] == 8
        assert push["replicas_used"][stage] == 4  # each 4-sample batch whole to one replica
    assert flow["makespan_s"] > 0 and push["makespan_s"] > 0
    assert flowrl_actor_names() == []


def test_the_median_row_is_the_median_run_and_keeps_every_repeat():
    runs = [
        {"flowrl": {"makespan_s": t}, "flowrl_over_sim": t / 2, "flowrl_over_bound": t / 4, "push": {"run": t}}
        for t in (0.3, 0.1, 0.2)
    ]
    row = median_row(runs)
    assert row["flowrl"] == {"makespan_s": 0.2} and row["push"] == {"run": 0.2}  # one run's own figures
    assert [r["makespan_s"] for r in row["flowrl_repeats"]] == [0.1, 0.2, 0.3]
    assert row["flowrl_repeats"][2] == {"makespan_s": 0.3, "over_sim": 0.15, "over_bound": 0.075}
    assert "flowrl_repeats" not in runs[0]  # the runs themselves are left as they were


def test_cli_lists_the_scenarios(capsys):
    assert cli(["loadtest", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in scenarios())


@pytest.mark.parametrize("before", ["cost/0", "cost/x", "/2", "Cost"])
def test_cli_refuses_a_before_that_is_not_a_splitter_and_a_micro_batch_count(before, capsys):
    with pytest.raises(SystemExit) as info:
        cli(["loadtest", "--before", before, "--scenario", "tiny-shards"])
    assert info.value.code == 2
    assert f"--before: expected a splitter, optionally /K micro-batches a shard (cost/1): {before!r}" in (
        capsys.readouterr().err
    )


@pytest.mark.slow
def test_ray_data_runs_the_same_workload_and_stamps_every_stage(ray_cluster):
    pytest.importorskip("pandas", reason="Ray Data needs pandas: pip install -e .[bench]")
    from flowrl._tools.baselines import run_ray_data

    w = scenarios()["prime-97"]
    data = run_ray_data(w)
    assert data["samples"] == 97
    assert data["makespan_s"] > 0 and data["wall_s"] >= data["makespan_s"]
    assert 1 <= data["replicas_used"]["policy"] <= 7 and 1 <= data["replicas_used"]["reward"] <= 3
