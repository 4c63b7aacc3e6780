"""Checkpoints: the safe state format, atomic folders, exact resume (after a killed driver, with
other replica counts) and trainer groups rebuilt from the last checkpoint."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import flowrl
import flowrl.testing
from flowrl._core.state_format import CheckpointDir, decode_state, encode_state
from flowrl.testing import flowrl_actor_names

sys.path.insert(0, str(Path(__file__).parent))
from _resume_models import CPU, make_engine, trained  # noqa: E402

INPROCESS = {"pipeline": {"backend": "inprocess"}, "policy_replicas": 1, "ranks": 1}


# ---- the state format ----
@pytest.mark.parametrize(
    "value",
    [
        {"a": 1, "b": [1.5, "x", None, True], 3: {"nested": b"raw"}},
        np.arange(12, dtype=np.int16).reshape(3, 4),
        np.zeros((0, 3), dtype=np.float32),
        np.float32(2.5),
        np.int64(-7),
        torch.randn(3, 4).to(torch.bfloat16),
        torch.tensor(3.0),
        torch.empty(0, 2),
        torch.tensor([True, False]),
        torch.arange(6).reshape(2, 3).t(),  # not contiguous
    ],
)
def test_state_round_trips_with_types_and_dtypes(value):
    back = decode_state(encode_state({"v": value}))["v"]
    if isinstance(value, torch.Tensor):
        assert back.dtype == value.dtype and back.shape == value.shape and torch.equal(back, value)
    elif isinstance(value, (np.ndarray, np.generic)):
        assert type(back) is type(value) and back.dtype == value.dtype and np.array_equal(back, value)
    else:
        assert back == value


def test_optimizer_and_rng_state_round_trip_and_load():
    module = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(module.parameters())
    module(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = decode_state(encode_state({"module": module.state_dict(), "optimizer": opt.state_dict()}))
    again = torch.optim.Adam(torch.nn.Linear(3, 2).parameters())
    again.load_state_dict(state["optimizer"])
    assert torch.equal(again.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize(
    "value, message",
    [
        (object(), "cannot save a builtins.object"),
        (np.array([1, "x"], dtype=object), "cannot save a numpy array of dtype object safely"),
        (np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]), "objects or records"),
    ],
)
def test_unsafe_values_are_refused_when_saving(value, message):
    with pytest.raises(flowrl.CheckpointError, match=message):
        encode_state({"v": value})


def test_damaged_file_is_a_checkpoint_error():
    with pytest.raises(flowrl.CheckpointError, match="damaged"):
        decode_state(encode_state({"w": np.arange(100)})[:-10])


# ---- the folder ----
def test_a_failed_write_leaves_the_previous_checkpoint_whole(tmp_path):
    store = CheckpointDir(tmp_path, keep=0)
    store.write(1, {"a": b"one"})

    with pytest.raises(TypeError):  # the second file fails after the first was written
        store.write(2, {"a": b"two", "b": 12345})  # type: ignore[dict-item]
    assert store.episodes() == [1] and store.read(store.latest(), "a") == b"one"
    assert [p.name for p in tmp_path.iterdir()] == ["episode-000001"]  # nothing half-written left


def test_a_crash_mid_write_is_ignored_then_cleaned_and_old_ones_pruned(tmp_path):
    store = CheckpointDir(tmp_path, keep=2)
    store.write(1, {"a": b"1"})
    crashed = tmp_path / ".tmp-000002-dead"  # what a process killed while writing leaves
    crashed.mkdir()
    (crashed / "a").write_bytes(b"half")
    assert store.latest() == store.path(1)
    store.write(2, {"a": b"2"})
    store.write(3, {"a": b"3"})
    store.write(3, {"a": b"3 again"})  # a rebuilt run writes the same episode again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["episode-000002", "episode-000003"]
    assert store.read(store.latest(), "a") == b"3 again"
    store.write(1, {"a": b"1 again"})  # a run gone back to episode 1: the later ones are another future
    assert store.episodes() == [1] and store.latest() == store.path(1)


# ---- resume, in one process (fast) ----
def test_resume_in_process_continues_exactly(tmp_path):
    ref, seen_ref = make_engine(**INPROCESS)
    ref.learn()
    first, seen_first = make_engine(num_episode=3, checkpoint_every=1, checkpoint_dir=str(tmp_path), **INPROCESS)
    first.learn()
    resumed, seen = make_engine(checkpoint_every=1, checkpoint_dir=str(tmp_path), **INPROCESS)
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
    first, _ = make_engine(num_episode=3, checkpoint_every=3, checkpoint_dir=str(tmp_path), eval_every=2, **INPROCESS)
    first.learn()
    resumed, _ = make_engine(checkpoint_dir=str(tmp_path), eval_every=2, **INPROCESS)
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
                "checkpoint_every": 1,
                "checkpoint_dir": str(tmp_path),
                "pipeline": {"backend": "inprocess"},
            },
        )
        e.set_dataset([{"x": np.zeros(1)} for _ in range(4)])
        return e

    engine(1).learn()
    stats = engine(2).learn()  # resumes after episode 1, whose loss was NaN
    assert [e.episode for e in stats.episodes] == [0, 1] and np.isnan(stats.episodes[0].metrics["t"]["loss"])


def test_resume_refuses_another_dataset_or_sampling(tmp_path):
    first, _ = make_engine(num_episode=1, checkpoint_every=1, checkpoint_dir=str(tmp_path), **INPROCESS)
    first.learn()
    other, _ = make_engine(checkpoint_dir=str(tmp_path), **INPROCESS)
    other.set_dataset(other._learning.dataset[:10])
    with pytest.raises(
        flowrl.CheckpointError, match=r"dataset_size=20, this run has dataset_size=10 \(the dataset's length\)"
    ):
        other.learn()
    seeded, _ = make_engine(checkpoint_dir=str(tmp_path), seed=4, **INPROCESS)
    with pytest.raises(flowrl.CheckpointError, match=r"seed=3, this run has seed=4 \(RunConfig.seed\)"):
        seeded.learn()


def test_resume_settings_are_checked_when_the_engine_is_made(tmp_path):
    with pytest.raises(flowrl.ConfigError, match="checkpoint_every=2 needs RunConfig.checkpoint_dir"):
        flowrl.RunConfig(sample_per_episode=4, checkpoint_every=2)
    first, _ = make_engine(num_episode=1, checkpoint_every=1, checkpoint_dir=str(tmp_path), **INPROCESS)
    first.learn()
    with pytest.raises(
        flowrl.CheckpointError, match=r'resume="never" but .* already holds checkpoints \(after episodes \[0, 1\]\)'
    ):
        make_engine(checkpoint_dir=str(tmp_path), resume="never", **INPROCESS)
    with pytest.raises(flowrl.CheckpointError, match="not a checkpoint folder"):
        make_engine(resume=str(tmp_path / "nowhere"), **INPROCESS)
    resumed, seen = make_engine(num_episode=2, resume=str(tmp_path / "episode-000001"), **INPROCESS)
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


def test_killed_run_resumed_with_other_replica_counts_is_exact(ray_cluster, tmp_path):
    ref = reference(2)
    script = Path(__file__).with_name("_killed_run_script.py")
    address = ray_cluster.get_runtime_context().gcs_address
    proc = subprocess.run(
        [sys.executable, str(script), address, str(tmp_path), "4"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(script.parent)},
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # killed mid-episode 4
    before = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [b["seen"]["episode"] for b in before] == [0, 1, 2, 3]
    resumed, seen = make_engine(policy_replicas=3, checkpoint_every=1, checkpoint_dir=str(tmp_path))
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
    [((1, 1), False, "host"), ((3, 0), False, "host"), ((3, 0), True, "host"), ((3, 0), False, "nccl")],
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
        checkpoint_every=2,
        checkpoint_dir=str(tmp_path),
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


def test_a_dead_trainer_rank_without_checkpoints_fails_with_a_named_error(ray_cluster, tmp_path):
    engine, _ = make_engine(die_at=(1, 0), marker=str(tmp_path / "died"))
    with pytest.raises(
        flowrl.ReplicaDiedError, match=r"(?s)'learner.train_step', replica 0.*set RunConfig.checkpoint_dir"
    ):
        engine.learn()
    assert flowrl_actor_names() == []


def test_trainer_rebuilds_are_bounded(ray_cluster, tmp_path):
    engine, _ = make_engine(
        die_at=(1, 1),
        marker=str(tmp_path / "died"),
        checkpoint_every=1,
        checkpoint_dir=str(tmp_path),
        max_trainer_restarts=0,
    )
    with pytest.raises(flowrl.ReplicaDiedError, match=r"rebuilt 0 times already \(RunConfig.max_trainer_restarts=0\)"):
        engine.learn()
    assert flowrl_actor_names() == []
