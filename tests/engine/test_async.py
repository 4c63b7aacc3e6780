"""Asynchronous, staleness-bounded training: the engine on a real local Ray cluster with
rollouts running ahead of a trainer that takes real time (the gate alone, sans-IO, is in
core/test_staleness.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from _resume_models import make_engine, trained

import flowrl
from flowrl._core.training.sampler import EpisodeSampler
from flowrl._core.training.staleness import histogram, train_version
from flowrl.testing import CountingTrainer, Scale, flowrl_actor_names

INPROCESS = {"pipeline": {"backend": "inprocess"}, "policy_replicas": 1, "ranks": 1}
EPISODES, PER_EPISODE = 6, 8


def seen_staleness(engine: flowrl.Engine) -> list[list[tuple[int, int, int]]]:
    """Per episode: (sample id, version it was generated with, staleness the trainer saw)."""
    out = []
    for episode in engine.train_results:
        rows = [
            (i, v, s)
            for step in episode["learner"]
            for r in step
            for i, v, s in zip(
                r["ids"], r["policy_version"], r.get("policy_staleness", [0] * len(r["ids"])), strict=True
            )
        ]
        out.append(rows)
    return out


def first_epoch_prompts(engine: flowrl.Engine) -> list[list[int]]:
    """Per episode: the dataset indices trained in its first epoch (two steps), sorted."""
    return [sorted(x for step in ep["learner"][:2] for r in step for x in r["idx"]) for ep in engine.train_results]


def drawn() -> list[list[int]]:
    """What the sampler draws per episode for these tests (20 prompts, not shuffled)."""
    sampler = EpisodeSampler(20, PER_EPISODE, 1)
    return [sorted(p for p, _ in sampler.next_episode()) for _ in range(EPISODES)]


def phases(engine: flowrl.Engine, name: str) -> list[tuple[int, float, float]]:
    return sorted((s.args["episode"], s.start, s.end) for s in engine.spans() if s.group == "engine" and s.name == name)


def test_max_staleness_zero_is_the_synchronous_loop(ray_cluster):
    sync, _ = make_engine(sync_every=1, max_relay_episode=0, num_episode=4)
    sync.learn()
    explicit, _ = make_engine(
        sync_every=1, max_relay_episode=0, num_episode=4, staleness={"max": 0, "on_stale": "wait"}
    )
    stats = explicit.learn()
    assert trained(explicit) == trained(sync)  # same batches, losses, weights
    assert all(e.staleness == {"policy": {0: PER_EPISODE}} for e in stats.episodes)
    rollouts, syncs = phases(explicit, "rollout"), phases(explicit, "sync")
    # the last sync has no rollout after it
    for (_, _, synced), (_, started, _) in zip(syncs, rollouts[1:], strict=False):
        assert started >= synced  # each rollout began after the previous episode's weights arrived
    assert all(e.wait_s == e.rollout_s for e in stats.episodes)


@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_rollouts_run_ahead_within_the_bound_and_every_sample_trains_once(ray_cluster, k):
    engine, _ = make_engine(
        sync_every=1,
        max_relay_episode=0,
        num_episode=EPISODES,
        staleness={"max": k},
        rollout_s=0.01,
        train_s=0.15,
        shuffle=False,
    )
    stats = engine.learn()
    assert flowrl_actor_names() == []
    rows = seen_staleness(engine)
    for e, episode in enumerate(rows):
        for _, version, seen in episode:
            assert seen == train_version(e, 1) - version <= k  # checked on every trained sample
    assert max(s for episode in rows for _, _, s in episode) >= 1  # rollouts did run ahead of training
    ids = [sid for episode in rows for sid, _, _ in episode]
    assert Counter(ids) == Counter(dict.fromkeys(range(EPISODES * PER_EPISODE), 2))  # two epochs: once in each
    assert stats.rollout["policy.forward_step"].samples == EPISODES * PER_EPISODE
    assert [e.samples for e in stats.episodes] == [PER_EPISODE] * EPISODES
    for e, episode_stats in enumerate(stats.episodes):
        assert episode_stats.staleness == histogram(
            [{"policy_version": v} for _, v, _ in rows[e][:PER_EPISODE]], {"policy": train_version(e, 1)}
        )
    assert first_epoch_prompts(engine) == drawn()  # the sampler's prompts, episode by episode
    rollouts, trains = phases(engine, "rollout"), phases(engine, "train")
    assert any(r0 < t1 and t0 < r1 for _, r0, r1 in rollouts for _, t0, t1 in trains)  # they overlapped in time
    lanes = {s.lane for s in engine.spans() if s.group == "engine" and s.name == "rollout"}
    assert lanes == {1}  # a lane of their own: the engine's lanes have no overlapping spans


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_stale_samples_are_dropped_or_generated_again_and_counted(ray_cluster, policy):
    engine, _ = make_engine(
        sync_every=1,
        max_relay_episode=0,
        num_episode=EPISODES,
        staleness={"on_stale": policy},
        rollout_s=0.05,
        train_s=0.02,
        shuffle=False,
    )
    stats = engine.learn()
    rows = seen_staleness(engine)
    assert all(seen == 0 for episode in rows for _, _, seen in episode)  # staleness.max=0 holds on every sample
    over = [e.dropped if policy == "drop" else e.regenerated for e in stats.episodes]
    # each rollout starts as the previous episode starts training: its first shards run on the
    # weights before that episode's sync, one version too old
    assert sum(over) > 0
    policy_calls = stats.rollout["policy.forward_step"].samples
    if policy == "drop":
        assert [e.samples for e in stats.episodes] == [PER_EPISODE - d for d in over]
        assert policy_calls == EPISODES * PER_EPISODE and all(e.regenerated == 0 for e in stats.episodes)
    else:
        assert [e.samples for e in stats.episodes] == [PER_EPISODE] * EPISODES
        assert policy_calls == EPISODES * PER_EPISODE + sum(over)  # each generated again once
        assert first_epoch_prompts(engine) == drawn()  # each generated again in its own episode
    ids = [sid for episode in rows for sid, _, _ in episode]
    assert len(ids) == 2 * len(set(ids))  # two epochs; no sample trained twice in one


def test_a_checkpoint_taken_while_a_rollout_ran_ahead_resumes_that_episode(tmp_path):
    first, seen_first = make_engine(
        max_relay_episode=0,
        num_episode=4,
        staleness={"max": 1},
        checkpoint={"every": 2, "dir": str(tmp_path)},
        **INPROCESS,
    )
    first.learn()
    resumed, seen = make_engine(
        max_relay_episode=0,
        num_episode=4,
        staleness={"max": 1},
        checkpoint={"resume": str(tmp_path / "episode-000002")},
        **INPROCESS,
    )
    resumed.learn()  # episodes 2 and 3: the rollouts the first run had drawn ahead are drawn again
    assert [(s["episode"], s["ids"], s["idx"]) for s in seen] == [
        (s["episode"], s["ids"], s["idx"]) for s in seen_first[2:]
    ]


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
def test_a_trainer_rebuilt_under_overlap_trains_each_episode_once(ray_cluster, tmp_path):
    ref, _ = make_engine(sync_every=1, max_relay_episode=0, staleness={"max": 1}, train_s=0.05)
    ref.learn()
    engine, seen = make_engine(
        sync_every=1,
        max_relay_episode=0,
        staleness={"max": 1},
        train_s=0.05,
        checkpoint={"every": 2, "dir": str(tmp_path)},
        die_at=(3, 0),
        marker=str(tmp_path / "died"),
    )
    stats = engine.learn()
    assert (tmp_path / "died").exists() and flowrl_actor_names() == []
    assert [e.episode for e in stats.episodes] == list(range(EPISODES))
    ids = [[r["ids"] for step in ep["learner"] for r in step] for ep in engine.train_results]
    assert ids == [[r["ids"] for step in ep["learner"] for r in step] for ep in ref.train_results]
    assert all(s <= 1 for episode in seen_staleness(engine) for _, _, s in episode)


def test_a_field_named_like_the_staleness_column_is_refused():
    class Clash(flowrl.Model):
        def forward_step(self, batch, iteration):
            return {"action": batch["prompt"], "policy_staleness": [0] * len(batch)}

        def set_weights(self, weights):
            pass

    from _resume_models import Learner

    policy = Clash("policy", {"batch_size": 4})
    learner = Learner("learner")
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[learner],
        sync=[(learner, policy)],
        config={
            "sample_per_episode": 4,
            "staleness": {"max": 1},
            "progress": "off",
            "pipeline": {"backend": "inprocess"},
        },
    )
    engine.set_dataset([{"idx": i, "prompt": np.zeros(4, dtype=np.float32)} for i in range(8)])
    with pytest.raises(flowrl.FlowDefinitionError, match="has a field 'policy_staleness': that name is reserved"):
        engine.learn()


class SeenTrainer(CountingTrainer):
    """Reports, per sample, each synced model's version and the staleness the engine added."""

    def train_step(self, batch, iteration):
        import time

        time.sleep(0.1)  # a trainer that takes time, so rollouts run ahead
        out = super().train_step(batch, iteration)
        for model in ("policy", "value"):
            out[model] = list(
                zip(
                    np.asarray(batch[f"{model}_version"]).tolist(),
                    np.asarray(batch[f"{model}_staleness"]).tolist(),
                    strict=True,
                )
            )
        return out


def test_every_synced_model_carries_its_own_version_and_each_is_bounded(ray_cluster):
    cpu = {"cpus_per_replica": 0.1}
    models = (
        Scale("policy", {"num_replicas": 2, "batch_size": 4, **cpu}, srcs=["query"], dst="policy_out", sleep_s=0.01),
        Scale("reference", {"num_replicas": 2, "batch_size": 2, **cpu}, srcs=["policy_out"], dst="ref_out"),
        Scale("reward", {"num_replicas": 2, "batch_size": 2, **cpu}, srcs=["ref_out", "value_out"], dst="reward_out"),
        Scale("value", {"num_replicas": 2, "batch_size": 2, **cpu}, srcs=["policy_out"], dst="value_out"),
        SeenTrainer("ppo_policy", {"num_replicas": 1, **cpu}),
        SeenTrainer("ppo_value", {"num_replicas": 1, **cpu}),
    )
    engine = flowrl.RLHFEngine(
        *models, {"sample_per_episode": 8, "num_episode": 5, "staleness": {"max": 1}, "progress": "off"}
    )
    engine.set_dataset([{"query": np.full(2, float(i))} for i in range(40)])
    stats = engine.learn()
    for e, episode in enumerate(engine.train_results):
        for model in ("policy", "value"):
            pairs = [p for step in episode["ppo_policy"] for r in step for p in r[model]]
            assert len(pairs) == 8 and all(lag == e - version <= 1 for version, lag in pairs), (e, model, pairs)
    assert set(stats.episodes[-1].staleness) == {"policy", "value"}
    assert any(1 in lags for e in stats.episodes for lags in e.staleness.values())  # the overlap happened
    assert flowrl_actor_names() == []
