"""The scalars of an episode, flattened from hand-made EngineStats (no engine, no event loop):
names, values, and the per-episode differences of the runtime's counters."""

from __future__ import annotations

from typing import Any

import pytest

import flowrl
from flowrl._engine.loggers import flatten, metric_key
from flowrl._engine.tracking import episode_scalars


def replica(r: int, busy_s: float, starved_s: float) -> flowrl.ReplicaStats:
    return flowrl.ReplicaStats(
        replica=r, samples=4, calls=2, busy_s=busy_s, idle_s=0.0, max_shard=2, starved_s=starved_s
    )


def stage(name: str, model: str, busy: list[float], starved: list[float], peak: int) -> flowrl.StageStats:
    reps = [replica(r, b, s) for r, (b, s) in enumerate(zip(busy, starved, strict=True))]
    return flowrl.StageStats(
        name=name, model=model, samples=8, calls=4, busy_s=sum(busy), max_shard=2, replicas=reps, queue_peak=peak
    )


def engine_stats(
    *, active_s: float, gen_busy: list[float], starved: list[float], rank_busy: list[float], **episode: Any
) -> flowrl.EngineStats:
    rollout = flowrl.PipelineStats(
        active_s=active_s,
        stages={
            "policy.forward_step": stage("policy.forward_step", "policy", gen_busy, starved, peak=6),
            "reward.forward_step": stage("reward.forward_step", "reward", [0.5], [0.0], peak=2),
        },
        blocked_s=0.25,
        serving={"policy": 2, "reward": 1},
    )
    ranks = [flowrl.RankStats(rank=r, samples=8, steps=3, busy_s=b) for r, b in enumerate(rank_busy)]
    trainers = {"learner": flowrl.TrainerStats(model="learner", samples=16, steps=3, ranks=ranks)}
    fields: dict[str, Any] = {
        "episode": 4,
        "samples": 8,
        "rollout_s": 2.0,
        "train_s": 1.0,
        "sync_s": 0.5,
        "eval_s": 0.0,
        "metrics": {"learner": {"loss": 0.25, "reward": 0.75, "kl": 0.01}},
        "weight_versions": {"policy": 5},
        "staleness": {"policy": {0: 6, 2: 2}},
        "wait_s": 1.5,
        "dropped": 1,
        **episode,
    }
    return flowrl.EngineStats(
        rollout=rollout, evaluation=None, trainers=trainers, episodes=[flowrl.EpisodeStats(**fields)]
    )


def test_an_episode_s_scalars_are_its_stats_by_name():
    stats = engine_stats(active_s=4.0, gen_busy=[2.0, 4.0], starved=[0.5, 0.25], rank_busy=[0.5, 1.0])
    assert episode_scalars(stats, seconds=4.0) == {
        "train/learner/loss": 0.25,  # whatever train_step returned, as EpisodeStats.metrics holds it
        "train/learner/reward": 0.75,
        "train/learner/kl": 0.01,
        "time/rollout_s": 2.0,
        "time/train_s": 1.0,
        "time/sync_s": 0.5,
        "time/eval_s": 0.0,
        "time/wait_s": 1.5,
        "episode/samples": 8.0,
        "episode/dropped": 1.0,
        "episode/failed": 0.0,
        "episode/regenerated": 0.0,
        "episode/episodes_per_s": 0.25,
        "staleness/policy/mean": 0.5,  # (6 x 0 + 2 x 2) / 8
        "staleness/policy/max": 2.0,
        "weights/policy/version": 5.0,
        "rollout/blocked_s": 0.25,
        "rollout/policy.forward_step/busy": 0.75,  # 6 busy seconds of 2 replicas x 4 s
        "rollout/policy.forward_step/queue_peak": 6.0,
        "rollout/reward.forward_step/busy": 0.125,
        "rollout/reward.forward_step/queue_peak": 2.0,
        "rollout/policy/starved_s": 0.75,
        "rollout/reward/starved_s": 0.0,
        "rollout/policy/replicas": 2.0,
        "rollout/reward/replicas": 1.0,
        "trainer/learner/busy": 0.75,  # 1.5 busy seconds of 2 ranks x 1 s of training
        "trainer/learner/steps": 3.0,
    }


def test_busy_and_starvation_are_the_episode_s_own_growth_of_the_counters():
    before = engine_stats(active_s=4.0, gen_busy=[2.0, 4.0], starved=[0.5, 0.25], rank_busy=[0.5, 1.0])
    now = engine_stats(active_s=6.0, gen_busy=[3.0, 4.5], starved=[1.5, 0.25], rank_busy=[1.0, 1.5])
    scalars = episode_scalars(now, before)
    assert scalars["rollout/policy.forward_step/busy"] == pytest.approx(1.5 / (2 * 2.0))
    assert scalars["rollout/policy/starved_s"] == pytest.approx(1.0)
    assert scalars["rollout/reward.forward_step/busy"] == 0.0  # no growth: idle all episode
    assert scalars["rollout/blocked_s"] == 0.0
    assert scalars["trainer/learner/busy"] == pytest.approx(1.0 / (2 * 1.0))
    assert "episode/episodes_per_s" not in scalars  # no wall time given


def test_no_busy_fraction_without_time_and_no_staleness_without_trained_samples():
    stats = engine_stats(active_s=0.0, gen_busy=[0.0], starved=[0.0], rank_busy=[0.0], train_s=0.0, staleness={})
    scalars = episode_scalars(stats)
    assert not any(k.endswith("/busy") or k.startswith("staleness/") for k in scalars)


@pytest.mark.parametrize(
    ("key", "safe"),
    [("train/learner/loss", "train/learner/loss"), ("kl(k3)", "kl_k3_"), ("a:b", "a_b"), ("x y-z.w", "x y-z.w")],
)
def test_mlflow_metric_names_keep_what_mlflow_takes(key, safe):
    assert metric_key(key) == safe


def test_the_config_as_mlflow_params_is_flat():
    config = {"sample_per_episode": 8, "pipeline": {"backend": "ray"}, "colocation": [["a", "b"]], "models": {}}
    assert dict(flatten(config)) == {
        "sample_per_episode": "8",
        "pipeline.backend": "ray",
        "colocation": '[["a", "b"]]',
        "models": "{}",
    }


def test_counters_gone_back_to_a_checkpoint_give_no_negative_busy_fraction():
    before = engine_stats(active_s=4.0, gen_busy=[2.0, 4.0], starved=[0.5, 0.25], rank_busy=[5.0, 5.0])
    now = engine_stats(active_s=6.0, gen_busy=[3.0, 4.5], starved=[1.5, 0.25], rank_busy=[1.0, 1.5])  # restored
    assert episode_scalars(now, before)["trainer/learner/busy"] == 0.0
