"""An engine sending weights by broadcast (``ModelConfig.weight_transport="nccl"``; gloo where
the weights are CPU tensors, as here), with a replica added mid-run. The pieces alone are in
backends/test_weight_share.py, the GPU variants in engine/test_gpu.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _linear_models import LinearTrainer

import flowrl
from flowrl.testing import flowrl_actor_names

torch = pytest.importorskip("torch")

CPU = {"cpus_per_replica": 0.1}


class Policy(flowrl.Model):
    """Reports the sum of the weights it computed with."""

    def setup(self) -> None:
        self.module = torch.nn.Linear(4, 1)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {
            f"{self.name}_w": [float(self.module.weight.detach().sum())] * len(batch),
            f"{self.name}_replica": [self.replica_id] * len(batch),
        }


@pytest.mark.parametrize("backend", ["ray", "inprocess"])
def test_nccl_transport_syncs_every_replica_and_one_added_mid_run(ray_cluster, backend):
    policy = Policy("policy", {"num_replicas": 2, "batch_size": 1, **CPU})
    trainer = LinearTrainer("trainer", {"weight_transport": "nccl", **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={"sample_per_episode": 8, "num_episode": 3, "progress": "off", "pipeline": {"backend": backend}},
    )
    engine.set_dataset([{"x": np.ones(4, dtype=np.float32) * (i % 3)} for i in range(24)])
    probe = [{"x": np.ones(4, dtype=np.float32)} for _ in range(24)]
    with engine:
        stats = engine.learn()
        trained = engine.train_results[-1]["trainer"][-1][0]["w_sum"]
        # one more rollout: every replica holds the weights the trainer had after episode 3
        before = engine._portal.call(engine._session.deployment.rollout.run, probe)
        assert engine.resize("policy", 3) == [2]  # joins with the weights the others hold
        after = engine._portal.call(engine._session.deployment.rollout.run, probe)
    assert [e.weight_versions["policy"] for e in stats.episodes] == [1, 2, 3]
    assert ("policy" in engine._session.weights.groups) == (
        backend == "ray"
    )  # broadcast on Ray; one process hands values over
    for e, episode in enumerate(engine.train_results[:-1]):  # episode e+1 generated with e+1's weights
        assert stats.episodes[e + 1].staleness == {"policy": {0: 8}}
        assert episode["trainer"][-1][0]["w_sum"] != trained
    assert {s["policy_replica"] for s in before} == {0, 1}
    assert {round(s["policy_w"], 5) for s in before} == {round(trained, 5)}
    assert 2 in {s["policy_replica"] for s in after}  # the added replica worked, on the same weights
    assert {round(s["policy_w"], 5) for s in after} == {round(trained, 5)}
    assert {s["policy_version"] for s in after} == {3}
    assert flowrl_actor_names() == []


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
def test_one_trainer_feeding_two_models_broadcasts_one_snapshot_that_a_later_join_still_gets(ray_cluster):
    policy = Policy("policy", {"num_replicas": 1, "batch_size": 1, **CPU})
    critic = Policy("critic", {"num_replicas": 1, "batch_size": 1, **CPU})
    trainer = LinearTrainer("trainer", {"weight_transport": "nccl", **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: critic.forward_step(policy.forward_step(x)),
        train=[trainer],
        sync=[(trainer, policy), (trainer, critic)],
        config={"sample_per_episode": 8, "num_episode": 3, "progress": "off"},
    )
    engine.set_dataset([{"x": np.ones(4, dtype=np.float32) * (i % 3)} for i in range(24)])
    probe = [{"x": np.ones(4, dtype=np.float32)} for _ in range(24)]
    with engine:
        engine.learn()
        trained = engine.train_results[-1]["trainer"][-1][0]["w_sum"]
        assert engine.resize("critic", 2) == [1] and engine.resize("policy", 2) == [1]
        after = engine._portal.call(engine._session.deployment.rollout.run, probe)
    for model in ("policy", "critic"):
        assert {s[f"{model}_replica"] for s in after} == {0, 1}, model  # the joined replicas worked
        assert {round(s[f"{model}_w"], 5) for s in after} == {round(trained, 5)}, model
    assert flowrl_actor_names() == []
