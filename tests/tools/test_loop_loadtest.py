"""The load test's loop scenarios (issue 23) run tiny, in process: every sample's turns and
segments run exactly once, no run beats the lower bound, the report has a row per mode."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from flowrl._sim.turns import MODES, lower_bound
from flowrl._tools import loop_scenarios as ls
from flowrl._tools.cli import main as cli


def tiny_multiturn() -> ls.LoopScenario:
    return ls.LoopScenario(replace(ls.multiturn_workload(6, seed=5, scale=0.1), budget=64), MODES)


def tiny_partial() -> ls.LoopScenario:
    return ls.LoopScenario(
        replace(ls.partial_workload(12, seed=6, scale=0.1), budget=64), ("whole", "partial"), env=False
    )


def check_rows(spec: ls.LoopScenario, rows: list[dict]) -> None:
    w = spec.workload
    assert [r["mode"] for r in rows] == list(spec.modes)
    turns = [len(s) for s in w.samples]
    for r in rows:
        f = r["flowrl"]
        assert f["makespan_s"] >= r["lower_bound_s"] == lower_bound(w)
        # the generations the run counted are the workload's, and the simulator's (a count that
        # does not depend on the schedule): each turn once, cut into segments when partial
        expected = ls.segments(spec.layout(r["mode"]))
        assert f["generations"] == r["sim_generations"] == sum(expected)
        assert r["turns"] == sum(turns) and r["samples"] == len(turns)
        taken = len(turns) if r["mode"] == "whole" else sum(expected)  # the agent takes a sample once
        assert set(f["samples_by_stage"].values()) == {taken}
        assert set(f["samples_by_stage"]) == ({"policy", "env"} if spec.env and r["mode"] != "whole" else {"policy"})
    by = {r["mode"]: r for r in rows}
    assert by["whole"]["over_whole"] == 1.0
    if "partial" in by:  # a budget smaller than the longest turn cuts it
        assert by["partial"]["flowrl"]["generations"] > sum(turns)
        assert by["partial"]["flowrl"]["policy_calls"] > by["whole"]["flowrl"]["policy_calls"]
    report = ls.loop_report(rows)
    for r in rows:
        assert f"| {r['scenario']} | {ls.LABELS[r['mode']]} | {r['samples']} | {r['turns']} |" in report


def test_multiturn_runs_every_turn_once_in_each_mode():
    spec = tiny_multiturn()
    assert max(len(s) for s in spec.workload.samples) > 1  # a multi-turn workload
    rows = ls.run_loop_scenario("multiturn", spec, repeats=1, backend="inprocess")
    check_rows(spec, rows)
    assert rows[1]["flowrl"]["generations"] == sum(len(s) for s in spec.workload.samples)  # per-turn: one a turn


def test_partial_cuts_each_long_generation_into_segments_once():
    spec = tiny_partial()
    assert all(len(s) == 1 for s in spec.workload.samples)
    rows = ls.run_loop_scenario("partial", spec, repeats=1, backend="inprocess")
    check_rows(spec, rows)


def test_a_run_whose_counts_differ_from_the_workload_fails(monkeypatch):
    spec = tiny_partial()
    real = ls.segments
    monkeypatch.setattr(ls, "segments", lambda w: [n + 1 for n in real(w)])  # expect one segment more
    with pytest.raises(RuntimeError, match="generations ran"):
        asyncio.run(ls.run_mode(spec, "partial", backend="inprocess"))


def test_repeats_give_the_median_and_every_run():
    spec = ls.LoopScenario(replace(ls.partial_workload(4, seed=7, scale=0.05), budget=64), ("whole",), env=False)
    (row,) = ls.run_loop_scenario("p", spec, repeats=3, backend="inprocess")
    assert len(row["runs_s"]) == 3 and row["flowrl"]["makespan_s"] == sorted(row["runs_s"])[1]


def test_cli_lists_and_accepts_the_loop_scenarios(capsys):
    assert cli(["loadtest", "--list"]) == 0
    out = capsys.readouterr().out
    for name, spec in ls.loop_scenarios().items():
        assert spec.describe(name) in out
    with pytest.raises(SystemExit):
        cli(["loadtest", "--scenario", "no-such-loop"])
    assert "multiturn" in capsys.readouterr().err
