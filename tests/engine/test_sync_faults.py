"""A policy replica whose process dies inside ``set_weights`` during a weight sync, on a real
local Ray cluster: it is retired from its pool as a death in a shard would retire it, and the
run goes on with the others; only when every replica has died does the run fail."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl.testing import flowrl_actor_names

torch = pytest.importorskip("torch")

CPU = {"cpus_per_replica": 0.1}
EPISODES, PER_EPISODE = 3, 8


class Policy(flowrl.Model):
    """Reports the sum of the weights it computed with; a replica in ``dying`` that takes a
    token from ``tokens`` (a ``ray.util.queue.Queue``) in ``set_weights`` kills its own process."""

    def __init__(self, name: str, config: Any, *, tokens: Any, dying: tuple[int, ...]) -> None:
        super().__init__(name, config)
        self.tokens, self.dying = tokens, dying

    def setup(self) -> None:
        self.module = torch.nn.Linear(4, 1)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {
            f"{self.name}_w": [float(self.module.weight.detach().sum())] * len(batch),
            f"{self.name}_replica": [self.replica_id] * len(batch),
        }

    def set_weights(self, weights: Any) -> None:
        if self.replica_id in self.dying and not self.tokens.empty():
            self.tokens.get()  # one death per token
            os.kill(os.getpid(), signal.SIGKILL)
        super().set_weights(weights)


class Trainer(flowrl.Model):
    def setup(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        loss = (self.module(torch.as_tensor(np.asarray(batch["x"], dtype=np.float32))).squeeze(1) - 1).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"w_sum": float(self.module.weight.detach().sum())}


def _engine(tokens: Any, dying: tuple[int, ...], transport: str, **config: Any) -> flowrl.Engine:
    policy = Policy("policy", {"num_replicas": 2, "batch_size": 1, **CPU}, tokens=tokens, dying=dying)
    trainer = Trainer("trainer", {"weight_transport": transport, **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={"sample_per_episode": PER_EPISODE, "num_episode": EPISODES, "progress": "off", **config},
    )
    engine.set_dataset([{"x": np.ones(4, dtype=np.float32) * (i % 3)} for i in range(EPISODES * PER_EPISODE)])
    return engine


@pytest.mark.parametrize(
    ("transport", "staleness"),
    [("host", 0), ("nccl", 0), ("host", 1)],
    ids=["host", "broadcast", "host-overlapped"],
)
def test_a_replica_killed_in_set_weights_is_retired_and_the_run_completes_on_the_other(
    ray_cluster, transport, staleness
):
    from ray.util.queue import Queue

    tokens = Queue(actor_options={"num_cpus": 0})
    tokens.put(True)  # replica 1 dies at the first sync
    probe = [{"x": np.ones(4, dtype=np.float32)} for _ in range(6)]
    engine = _engine(tokens, (1,), transport, max_staleness=staleness)
    try:
        with engine:
            stats = engine.learn()
            trained = engine.train_results[-1]["trainer"][-1][0]["w_sum"]
            rollout = engine._session.deployment.rollout
            before = engine._portal.call(rollout.run, probe)
            serving = rollout.serving("policy")
            groups = dict(engine._session.weights.groups)
            assert engine.resize("policy", 2) == [2]  # a new replica (ids are not reused) joins
            after = engine._portal.call(rollout.run, probe)
            final = engine.stats()
        left_empty = tokens.empty()
    finally:
        tokens.shutdown()
    assert left_empty  # the death happened
    assert [e.weight_versions["policy"] for e in stats.episodes] == [1, 2, 3]
    policy = stats.rollout.stages["policy.forward_step"]
    assert policy.samples == EPISODES * PER_EPISODE  # every sample counted once
    if not staleness:  # the sync ran between rollouts: the dead replica held no shard
        assert policy.retried == 0
    assert serving == [0] and stats.rollout.serving == {"policy": 1}
    # the survivor holds the last version: it computes with the trainer's final weights
    assert {s["policy_replica"] for s in before} == {0}
    assert {round(s["policy_w"], 5) for s in before} == {round(trained, 5)}
    assert {s["policy_version"] for s in before} == {EPISODES}
    if transport == "nccl":  # the last broadcast's group holds the survivor only (and the trainer)
        assert len(groups["policy"][0]) == 3
    # the replica added after the retirement got the current weights too
    assert 2 in {s["policy_replica"] for s in after}
    assert {round(s["policy_w"], 5) for s in after} == {round(trained, 5)}
    assert {s["policy_version"] for s in after} == {EPISODES}
    assert final.rollout.serving == {"policy": 2}
    assert flowrl_actor_names() == []  # the dead replica's actor too


def test_when_every_replica_dies_in_set_weights_the_run_fails_naming_the_model(ray_cluster):
    from ray.util.queue import Queue

    tokens = Queue(actor_options={"num_cpus": 0})
    for _ in range(2):
        tokens.put(True)
    engine = _engine(tokens, (0, 1), "host")
    try:
        with pytest.raises(flowrl.ReplicaDiedError, match="every replica of model 'policy' has died") as info:
            with engine:
                engine.learn()
        left_empty = tokens.empty()
    finally:
        tokens.shutdown()
    assert left_empty  # both died
    assert info.value.stage == "policy.set_weights"
    assert flowrl_actor_names() == []
