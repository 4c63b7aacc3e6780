"""Chaos: an engine in deterministic mode whose policy, scorer and trainer processes are killed
at points drawn from a seed ends with bitwise the same trained weights and the same per-episode
results as the same run without faults; every sample is counted once and the pools are back at
their size. Real Ray actors; deaths are the processes exiting (``os._exit``), replacements and
trainer rebuilds are flowrl's own.

The models and the run are in ``tests/helpers/_chaos_models.py``. The short run is in the
default suite; the long one (more episodes and kills) and one with a node lost as well
(``_chaos_node_script.py``, on a cluster of its own) are behind ``-m slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from flowrl.testing import flowrl_actor_names

pytest.importorskip("torch")
from _chaos_models import PER_EPISODE, facts, run, summary  # noqa: E402 - after the skip: it imports torch


def check_same_as_calm(
    result: dict[str, Any], lost_with_node: dict[str, int] | None = None, ranks: int = 1
) -> dict[str, int]:
    """``result``: ``_chaos_models.summary``; ``lost_with_node``: replicas per model that went with a
    node; ``ranks``: the trainer's."""
    assert result["finite"] and result["same"]
    calm, chaos = result["calm"], result["chaos"]
    assert calm["killed"] == {"policy": 0, "scorer": 0, "trainer": 0}
    assert calm["recovery_s"] == {"policy": [], "scorer": []} and calm["rebuilds"] == []
    lost = lost_with_node or {}
    for model in ("policy", "scorer"):  # each death replaced once, its time measured
        times = chaos["recovery_s"][model]
        assert len(times) == chaos["killed"][model] + lost.get(model, 0), (model, chaos)
        assert all(t is not None and t >= 0 for t in times)
    rebuilds, deaths = chaos["rebuilds"], chaos["killed"]["trainer"] + lost.get("trainer", 0)
    # each death rebuilds the trainer once; ranks dying in one step rebuild it once for all
    if ranks == 1:
        assert len(rebuilds) == deaths
    else:
        assert len(rebuilds) <= deaths and (len(rebuilds) > 0) == (deaths > 0)
    assert all(t == "trainer" and rank < ranks and s > 0 for t, rank, s, _ in rebuilds)
    assert all(source == "checkpoint" for *_, source in rebuilds) or ranks > 1
    for r in (calm, chaos):
        assert r["both_stages_saw_each_sample"] and r["episodes_in_order"] and r["trained"] == calm["trained"]
        assert r["serving"] == {"policy": 2, "scorer": 2}  # the pools back at their size
    return chaos["killed"]


def in_process(
    tmp_path: Path, episodes: int, deaths: dict[str, int], seed: int, ranks: int = 1, **layout: bool
) -> tuple[dict[str, int], list[str]]:
    """The kills per model and the sources of the trainer's rebuilds. ``ranks``: the trainer's, in
    both runs; ``layout``: the run with kills' (``gpus``, ``colocate`` of ``_chaos_models.run``);
    the calm run asks for no GPU."""
    calm = run(tmp_path / "calm", episodes, {}, seed, ranks=ranks)
    chaotic = run(tmp_path / "chaos", episodes, deaths, seed, ranks=ranks, **layout)
    result = summary(calm, chaotic, episodes)
    killed = check_same_as_calm(result, ranks=ranks)
    assert flowrl_actor_names() == []
    return killed, [source for *_, source in result["chaos"]["rebuilds"]]


def test_a_run_with_kills_ends_bit_for_bit_where_a_calm_run_ends(ray_cluster, tmp_path):
    # on GPUs colocated as RLHF runs place them: a replacement takes the bundle (the GPU share) of
    # the replica it replaces, the only room there is for it
    # the trainer on two ranks: one killed at the start of a step is rebuilt from the other's state
    deaths = {"policy": 2, "scorer": 2, "trainer": 1}
    killed, sources = in_process(tmp_path, 4, deaths, seed=7, ranks=2, gpus=True, colocate=True)
    assert killed["policy"] + killed["scorer"] >= 2, killed  # the draws did kill (p=0.3 over dozens of calls)
    assert sources == ["survivor"], sources


@pytest.mark.slow
def test_a_long_run_with_many_kills_ends_bit_for_bit_where_a_calm_run_ends(ray_cluster, tmp_path):
    killed, sources = in_process(tmp_path, 10, {"policy": 10, "scorer": 10, "trainer": 3}, seed=11)
    assert sum(killed.values()) >= 20, killed
    assert sources == ["checkpoint"] * 3  # one rank: no survivor


@pytest.mark.slow
def test_a_run_with_kills_and_a_node_lost_ends_bit_for_bit_where_a_calm_run_ends(tmp_path):
    """On a cluster of its own (``ray.cluster_utils``), in a fresh process: one pool's replicas
    on a worker node, which is removed once the run has written the checkpoint of an episode
    drawn from the seed; a spare node gives their replacements room."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    script = Path(__file__).with_name("_chaos_node_script.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=900, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    held = result["held"]
    assert len(held["policy"]) + len(held["scorer"]) == 2, held  # one pool's two replicas were on the node
    killed = check_same_as_calm(result, {m: len(v) for m, v in held.items()})
    assert sum(killed.values()) >= 20, killed
    assert result["left_after"] == []


@pytest.mark.slow
def test_an_asynchronous_run_replayed_with_kills_ends_bit_for_bit_where_its_recorded_run_ends(ray_cluster, tmp_path):
    """Rollouts one version ahead of training (``staleness.max`` 1): which weights generated each
    sample is timing's choice. The calm run records it; the run with kills replays that record,
    so every sample meets the same weights whatever the deaths did to the timing."""
    record = tmp_path / "schedule.jsonl"
    calm = run(tmp_path / "calm", 6, {}, 5, staleness=1, schedule={"record_schedule": str(record)})
    lines = [json.loads(line) for line in record.read_text().splitlines()[1:]]  # the first: settings
    behind = sum(v < e["episode"] for e in lines for r in e["runs"] for v in r["versions"]["policy"])
    assert behind > 0, "no sample was generated a version behind: the run was not asynchronous"
    deaths = {"policy": 3, "scorer": 3, "trainer": 2}
    chaotic = run(tmp_path / "chaos", 6, deaths, 5, staleness=1, schedule={"replay_schedule": str(record)})
    killed = check_same_as_calm(summary(calm, chaotic, 6))
    assert sum(killed.values()) >= 4, killed
    assert flowrl_actor_names() == []


@pytest.mark.slow
def test_without_deterministic_mode_a_run_with_kills_loses_and_repeats_no_sample(ray_cluster, tmp_path):
    """Shards cut by timing: the numbers may differ from a calm run's, the counts may not."""
    episodes, deaths = 6, {"policy": 3, "scorer": 3, "trainer": 2}
    chaos = facts(run(tmp_path, episodes, deaths, 13, deterministic=False), episodes)
    assert chaos["trained"] == episodes * PER_EPISODE  # each sample trained once, rebuilds' redone episodes not twice
    assert chaos["both_stages_saw_each_sample"] and chaos["episodes_in_order"]
    assert chaos["serving"] == {"policy": 2, "scorer": 2}
    for model in ("policy", "scorer"):
        assert len(chaos["recovery_s"][model]) == chaos["killed"][model]
    assert len(chaos["rebuilds"]) == chaos["killed"]["trainer"]
    assert sum(chaos["killed"].values()) >= 4, chaos["killed"]
    assert flowrl_actor_names() == []
