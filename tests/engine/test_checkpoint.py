"""Checkpoints of an engine: exact resume (in process, and after a killed driver with other
replica counts) and trainer groups whose rank died rebuilt from the last checkpoint or from a
surviving rank (the state format and the folders alone, sans-IO, are in
core/test_state_format.py)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import _resume_models
import numpy as np
import pytest
from _resume_models import CPU, make_engine, trained

import flowrl
import flowrl.testing
from flowrl.testing import flowrl_actor_names

INPROCESS = {"pipeline": {"backend": "inprocess"}, "policy_replicas": 1, "ranks": 1}


# ---- resume, in one process (fast) ----
def test_resume_in_process_continues_exactly(tmp_path):
    ref, seen_ref = make_engine(**INPROCESS)
    ref.learn()
    first, seen_first = make_engine(num_episode=3, checkpoint={"every": 1, "dir": str(tmp_path)}, **INPROCESS)
    first.learn()
    resumed, seen = make_engine(checkpoint={"every": 1, "dir": str(tmp_path)}, **INPROCESS)
    stats = resumed.learn()  # runs episodes 3..5: the first learn() ends at num_episode
    assert seen_first + seen == seen_ref
    assert trained(first) + trained(resumed) == trained(ref)
    assert [e.episode for e in stats.episodes] == list(range(6))
    assert stats.trainers["learner"].steps == ref.stats().trainers["learner"].steps


def test_resume_continues_evaluation_ids_and_iterations(tmp_path):
    def evals(engine):
        return [([s.id for s in run], [float(s["action"]) for s in run]) for run in engine.eval_results]

    ref, _ = make_engine(eval_every=2, **INPROCESS)
    ref.learn()
    first, _ = make_engine(num_episode=3, checkpoint={"every": 3, "dir": str(tmp_path)}, eval_every=2, **INPROCESS)
    first.learn()
    resumed, _ = make_engine(checkpoint={"dir": str(tmp_path)}, eval_every=2, **INPROCESS)
    resumed.learn()
    assert evals(first) + evals(resumed) == evals(ref)  # ids 0-2, 3-5, 6-8; the policy's outputs too
    assert [ids for ids, _ in evals(ref)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


class NanTrainer(flowrl.Model):
    def train_step(self, batch, iteration):
        return {"loss": float("nan"), "size": float(len(batch))}

    def checkpoint_state(self):
        return {}

    def restore_state(self, state):
        pass


def test_a_nan_metric_in_the_episode_stats_does_not_break_resume(tmp_path):
    def engine(episodes: int) -> flowrl.Engine:
        policy = flowrl.testing.Scale("policy", {"num_replicas": 1, "batch_size": 2}, srcs=["x"], dst="y")
        e = flowrl.Engine(
            rollout=lambda x: policy.forward_step(x),
            train=[NanTrainer("t")],
            config={
                "sample_per_episode": 2,
                "num_episode": episodes,
                "checkpoint": {"every": 1, "dir": str(tmp_path)},
                "pipeline": {"backend": "inprocess"},
            },
        )
        e.set_dataset([{"x": np.zeros(1)} for _ in range(4)])
        return e

    engine(1).learn()
    stats = engine(2).learn()  # resumes after episode 1, whose loss was NaN
    assert [e.episode for e in stats.episodes] == [0, 1] and np.isnan(stats.episodes[0].metrics["t"]["loss"])


def test_resume_refuses_another_dataset_or_sampling(tmp_path):
    first, _ = make_engine(num_episode=1, checkpoint={"every": 1, "dir": str(tmp_path)}, **INPROCESS)
    first.learn()
    other, _ = make_engine(checkpoint={"dir": str(tmp_path)}, **INPROCESS)
    other.set_dataset(other._learning.dataset[:10])
    with pytest.raises(
        flowrl.CheckpointError, match=r"dataset_size=20, this run has dataset_size=10 \(the dataset's length\)"
    ):
        other.learn()
    seeded, _ = make_engine(checkpoint={"dir": str(tmp_path)}, seed=4, **INPROCESS)
    with pytest.raises(flowrl.CheckpointError, match=r"seed=3, this run has seed=4 \(RunConfig.seed\)"):
        seeded.learn()


def test_resume_settings_are_checked_when_the_engine_is_made(tmp_path):
    with pytest.raises(flowrl.ConfigError, match="checkpoint.every=2 needs RunConfig.checkpoint.dir"):
        flowrl.RunConfig(sample_per_episode=4, checkpoint={"every": 2})
    first, _ = make_engine(num_episode=1, checkpoint={"every": 1, "dir": str(tmp_path)}, **INPROCESS)
    first.learn()
    with pytest.raises(
        flowrl.CheckpointError, match=r'resume="never" but .* already holds checkpoints \(after episodes \[0, 1\]\)'
    ):
        make_engine(checkpoint={"dir": str(tmp_path), "resume": "never"}, **INPROCESS)
    with pytest.raises(flowrl.CheckpointError, match="not a checkpoint folder"):
        make_engine(checkpoint={"resume": str(tmp_path / "nowhere")}, **INPROCESS)
    resumed, seen = make_engine(num_episode=2, checkpoint={"resume": str(tmp_path / "episode-000001")}, **INPROCESS)
    resumed.learn()  # from an explicit folder, without writing any
    assert [s["episode"] for s in seen] == [1]


# ---- on a real Ray cluster ----
@functools.cache
def reference(sync_every: int) -> dict[str, Any]:
    """The uninterrupted run on Ray: what every interrupted one must reproduce."""
    engine, seen = make_engine(sync_every=sync_every)
    stats = engine.learn()
    return {
        "seen": seen,
        "trained": trained(engine),
        "steps": stats.trainers["learner"].steps,
        "versions": stats.episodes[-1].weight_versions,
    }


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
def test_killed_run_resumed_with_other_replica_counts_is_exact(ray_cluster, tmp_path):
    ref = reference(2)
    script = Path(__file__).with_name("_killed_run_script.py")
    address = ray_cluster.get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, str(script), address, str(tmp_path), "4"],
        capture_output=True,
        text=True,
        timeout=300,
        # the flowrl this process imports, and _resume_models from tests/helpers
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(_resume_models.__file__).parent), *sys.path])},
    )
    assert proc.returncode == 1 and proc.stdout, proc.stderr[-3000:]  # killed mid-episode 4
    before = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [b["seen"]["episode"] for b in before] == [0, 1, 2, 3]
    resumed, seen = make_engine(policy_replicas=3, checkpoint={"every": 1, "dir": str(tmp_path)})
    with resumed:
        resumed.learn()
        assert len([n for n in flowrl_actor_names() if "-policy-" in n]) == 3
    ids = [i for b in before for i in b["seen"]["ids"]] + [i for s in seen for i in s["ids"]]
    want = [i for s in ref["seen"] for i in s["ids"]]
    got, expected = Counter(ids), Counter(want)
    assert sum((expected - got).values()) == 0 and sum((got - expected).values()) == 0  # skipped, repeated
    assert [b["seen"] for b in before] + seen == ref["seen"]  # same prompts, order, policy outputs
    assert [b["trained"] for b in before] + trained(resumed) == ref["trained"]  # same batches, losses, weights
    assert resumed.stats().episodes[-1].weight_versions == ref["versions"] == {"policy": 3}
    assert flowrl_actor_names() == []


@pytest.mark.parametrize(
    "die_at, peer_first, transport",
    [
        pytest.param((1, 1), False, "host", marks=pytest.mark.slow),
        pytest.param((3, 0), False, "host", marks=pytest.mark.slow),
        ((3, 0), True, "host"),
        pytest.param((3, 0), False, "nccl", marks=pytest.mark.slow),
    ],
    ids=["before-first-checkpoint", "after-second", "peer-error-races-the-death", "by-broadcast"],
)
def test_a_dead_trainer_rank_is_rebuilt_from_the_last_checkpoint(ray_cluster, tmp_path, die_at, peer_first, transport):
    """A rank dies mid-step. With ``peer_first`` its peer raises a collective's error as soon as
    the death happens, racing the death's own report to the driver: whichever comes first, the
    group is rebuilt (a peer's error alone once failed the run). With weights broadcast (gloo
    here), the rebuilt trainer's groups replace the dead one's and the run is the same."""
    ref = reference(1)
    learner = {"learner": {"num_replicas": 2, **CPU, "weight_transport": transport}}
    engine, seen = make_engine(
        sync_every=1,
        checkpoint={"every": 2, "dir": str(tmp_path), "rebuild_from_survivor": False},
        models=learner,
        die_at=die_at,
        marker=str(tmp_path / "died"),
        peer_first=peer_first,
    )
    stats = engine.learn()
    assert (tmp_path / "died").exists() and flowrl_actor_names() == []
    assert trained(engine) == ref["trained"]  # every step once, from the checkpoint's exact state
    assert stats.trainers["learner"].steps == ref["steps"]
    assert [e.episode for e in stats.episodes] == list(range(6))
    # the episodes after the checkpoint ran again, with the same prompts and policy weights
    episode, back = die_at[0], die_at[0] // 2 * 2  # the last checkpoint before the death
    assert [s["episode"] for s in seen] == [*range(episode + 1), *range(back, 6)]
    assert all(s == ref["seen"][s["episode"]] for s in seen)


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
def test_a_rank_that_dies_again_while_its_trainer_is_rebuilt_starts_the_rebuild_again(ray_cluster, tmp_path):
    ref = reference(1)
    engine, seen = make_engine(
        sync_every=1,
        checkpoint={"every": 2, "dir": str(tmp_path), "rebuild_from_survivor": False},
        die_at=(3, 0),
        marker=str(tmp_path / "died"),
        again_in_setup=True,
    )
    stats = engine.learn()
    assert (tmp_path / "died").exists() and (tmp_path / "died.setup").exists()  # both deaths happened
    assert trained(engine) == ref["trained"]  # every step once, as if nothing had died
    assert [s["episode"] for s in seen] == [0, 1, 2, 3, 2, 3, 4, 5]  # back to the checkpoint after episode 2
    ((rebuilt,),) = [stats.rebuilds]  # one rebuild, started twice
    assert (rebuilt.trainer, rebuilt.rank, rebuilt.episode, rebuilt.redone) == ("learner", 0, 2, 1)
    assert rebuilt.seconds > 0
    assert flowrl_actor_names() == []


def test_a_dead_trainer_rank_without_checkpoints_fails_with_a_named_error(ray_cluster, tmp_path):
    engine, _ = make_engine(die_at=(1, 0), marker=str(tmp_path / "died"), checkpoint={"rebuild_from_survivor": False})
    with pytest.raises(
        flowrl.ReplicaDiedError, match=r"(?s)'learner.train_step', replica 0.*set RunConfig.checkpoint.dir"
    ):
        engine.learn()
    assert flowrl_actor_names() == []


def test_trainer_rebuilds_are_bounded(ray_cluster, tmp_path):
    engine, _ = make_engine(
        die_at=(1, 1),
        marker=str(tmp_path / "died"),
        checkpoint={"every": 1, "dir": str(tmp_path), "max_trainer_restarts": 0},
    )
    with pytest.raises(
        flowrl.ReplicaDiedError, match=r"rebuilt 0 times already \(RunConfig.checkpoint.max_trainer_restarts=0\)"
    ):
        engine.learn()
    assert flowrl_actor_names() == []


@pytest.mark.parametrize(
    "die_at, peer_first, transport",
    [
        ((0, 0), False, "host"),
        ((1, 1), False, "host"),
        ((3, 0), True, "host"),
        pytest.param((3, 0), False, "nccl", marks=pytest.mark.slow),
    ],
    ids=["first-step", "rank-1", "peer-error-races-the-death", "by-broadcast"],
)
def test_a_dead_trainer_rank_is_rebuilt_from_a_survivor_without_a_checkpoint(
    ray_cluster, tmp_path, die_at, peer_first, transport
):
    """A rank dies at the start of a step (the group's first, too), its peer in the gradient sum:
    the peer's state is the one the step began with, so new ranks start from it, each with its
    generators as of its last step, and only that step runs again: no episode is redone, and
    every loss (drawn from the ranks' generators) and weight is the uninterrupted run's."""
    ref = reference(1)
    learner = {"learner": {"num_replicas": 2, **CPU, "weight_transport": transport}}
    engine, seen = make_engine(
        sync_every=1, models=learner, die_at=die_at, marker=str(tmp_path / "died"), peer_first=peer_first
    )
    stats = engine.learn()
    assert (tmp_path / "died").exists() and flowrl_actor_names() == []
    assert trained(engine) == ref["trained"] and stats.trainers["learner"].steps == ref["steps"]
    assert [s["episode"] for s in seen] == list(range(6)) and seen == ref["seen"]
    ((rebuilt,),) = [stats.rebuilds]
    assert (rebuilt.trainer, rebuilt.rank, rebuilt.episode, rebuilt.redone, rebuilt.source) == (
        "learner",
        die_at[1],
        die_at[0],
        0,
        "survivor",
    )


def test_a_rank_that_dies_after_the_gradient_sum_is_rebuilt_from_the_checkpoint(ray_cluster, tmp_path):
    """Its peer stepped on the summed gradients: the peer's state is not the one the step
    began with, so the group goes back to the last checkpoint, the episodes since run again."""
    ref = reference(1)
    engine, seen = make_engine(
        sync_every=1,
        checkpoint={"every": 2, "dir": str(tmp_path)},
        die_at=(3, 1),
        after_sum=True,
        marker=str(tmp_path / "died"),
    )
    stats = engine.learn()
    assert (tmp_path / "died").exists() and flowrl_actor_names() == []
    assert trained(engine) == ref["trained"]
    assert [s["episode"] for s in seen] == [0, 1, 2, 3, 2, 3, 4, 5]
    ((rebuilt,),) = [stats.rebuilds]
    assert (rebuilt.source, rebuilt.episode, rebuilt.redone) == ("checkpoint", 2, 1)
