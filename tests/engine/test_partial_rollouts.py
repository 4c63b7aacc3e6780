"""Partial rollouts in the engine: a loop whose body calls a synced policy generates each sample
in segments, each segment on whatever replica pulls it and with the weights that replica holds
then; every segment's version is recorded, and the staleness bound holds on every trained
sample by its oldest segment (asynchronous training, weights synced while rollouts run)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl._core.staleness import train_version
from flowrl.testing import flowrl_actor_names

CPU = {"cpus_per_replica": 0.25}
TOKENS = 2  # a segment's token budget
EPISODES, PER_EPISODE = 5, 8


class Segmenter(flowrl.Model):
    """Writes up to TOKENS tokens a call, each token the version of the weights that wrote it."""

    def set_weights(self, weights: Any) -> None:
        pass

    @flowrl.step
    def generate(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        response = []
        for text, length in zip(batch["response"], batch["length"], strict=True):
            n = min(TOKENS, int(length) - len(text))
            response.append([*text, *[self.weight_version] * n])
        finished = [len(r) >= int(n) for r, n in zip(response, batch["length"], strict=True)]
        return {"response": response, "finished": finished}


class Learner(flowrl.Model):
    """Learns nothing; reports what each trained sample carried."""

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {
            "ids": batch.ids.tolist(),
            "response": [list(r) for r in batch["response"]],
            "versions": [list(v) for v in batch["policy_versions"]],
            "staleness": [int(s) for s in batch.get("policy_staleness", [0] * len(batch))],
        }

    def get_weights(self) -> dict[str, Any]:
        return {"w": np.zeros(1)}


def engine(backend: str, max_staleness: int, segment: str = "oldest") -> flowrl.Engine:
    policy = Segmenter("policy", {"num_replicas": 2, "batch_size": 3, **CPU})
    learner = Learner("learner", {**CPU})

    def rollout(prompts: Any) -> Any:
        return flowrl.loop(policy.generate, prompts, until="finished", max_turns=10, name="segment")

    config = {
        "sample_per_episode": PER_EPISODE,
        "num_episode": EPISODES,
        "train_global_batch_size": 4,
        "max_staleness": max_staleness,
        "stale_segment": segment,
        "pipeline": {"backend": backend},
    }
    built = flowrl.Engine(rollout=rollout, train=[learner], sync=[(learner, policy)], config=config)
    built.set_dataset([{"response": [], "length": 1 + (i * 3) % 7} for i in range(16)])
    return built


@pytest.mark.parametrize("backend, k", [("inprocess", 1), ("ray", 1), ("inprocess", 0)])
def test_every_segment_records_its_version_and_the_bound_holds_on_the_oldest(ray_cluster, backend, k):
    run = engine(backend, k)
    stats = run.learn()
    if backend == "ray":
        assert flowrl_actor_names() == []
    segments = 0
    for e, episode in enumerate(run.train_results):
        rows = [row for step in episode["learner"] for r in step for row in zip(*r.values(), strict=True)]
        assert len(rows) == PER_EPISODE
        for _, response, versions, seen in rows:
            # a segment of TOKENS tokens per version recorded, each token written by those weights
            sizes = [min(TOKENS, len(response) - TOKENS * i) for i in range(len(versions))]
            assert response == [v for v, n in zip(versions, sizes, strict=True) for _ in range(n)]
            assert len(versions) == -(-len(response) // TOKENS)
            assert seen == train_version(e, 1) - min(versions) <= k  # the oldest segment, within the bound
            segments += len(versions)
        assert sum(stats.episodes[e].segment_staleness["policy"].values()) == sum(len(v) for _, _, v, _ in rows)
    assert stats.rollout.loops["segment"].turns == segments


def test_the_newest_segment_may_count_instead():
    stats = engine("inprocess", 1, segment="newest").learn()
    for episode in stats.episodes:  # per sample by its newest segment: never staler than its oldest
        oldest = max(episode.segment_staleness["policy"])
        assert max(episode.staleness["policy"]) <= oldest


def test_a_bad_stale_segment_is_refused():
    with pytest.raises(flowrl.ConfigError, match=r"RunConfig.stale_segment must be one of \['oldest', 'newest'\]"):
        flowrl.RunConfig(sample_per_episode=1, stale_segment="middle")
