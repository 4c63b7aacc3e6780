"""A partial-rollout engine whose every output is a function of the weights' versions and the
data (shared by engine/test_partial_rollouts.py and the script it kills mid-turn)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import flowrl
from flowrl.testing import CountingTrainer

CPU = {"cpus_per_replica": 0.25}
TOKENS = 2  # a segment's token budget


class Segmenter(flowrl.Model):
    """Writes up to TOKENS tokens a call, each token the version of the weights that wrote it.
    With ``die_in`` = (run, folder): the driver's process is killed in that run's first call that
    continues a sample (a turn after the first), after a marker is written into the folder (in
    process the replica is the driver; on Ray it kills the driver from its actor)."""

    def __init__(self, name: str, config: dict[str, Any], die_in: tuple[int, str] | None = None) -> None:
        super().__init__(name, config)
        self.die_in = die_in
        self.driver = os.getpid()  # pickled with the model: the driver's, in every replica

    def set_weights(self, weights: Any) -> None:
        pass

    @flowrl.step
    def generate(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        continuing = [len(t) for t in batch["response"] if len(t)]
        if self.die_in is not None and iteration == self.die_in[0] and continuing:
            Path(self.die_in[1], "died-mid-turn").write_text(str(continuing))
            os.kill(self.driver, signal.SIGKILL)
            time.sleep(60)  # on Ray: the driver is gone, and this actor with it
        response = []
        for text, length in zip(batch["response"], batch["length"], strict=True):
            n = min(TOKENS, int(length) - len(text))
            response.append([*text, *[self.weight_version] * n])
        finished = [len(r) >= int(n) for r, n in zip(response, batch["length"], strict=True)]
        return {"response": response, "finished": finished}


class Learner(CountingTrainer):
    """Counts its steps (its weights, as CountingTrainer); reports what each trained sample carried."""

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self.steps += 1
        return {
            "ids": batch.ids.tolist(),
            "response": [list(r) for r in batch["response"]],
            "versions": [list(v) for v in batch["policy_versions"]],
            "staleness": [int(s) for s in batch.get("policy_staleness", [0] * len(batch))],
        }


def engine(
    backend: str,
    max_staleness: int = 0,
    segment: str = "oldest",
    replicas: int = 2,
    die_in: tuple[int, str] | None = None,
    **config: Any,
) -> flowrl.Engine:
    policy = Segmenter("policy", {"num_replicas": replicas, "batch_size": 3, **CPU}, die_in)
    learner = Learner("learner", {**CPU})

    def rollout(prompts: Any) -> Any:
        return flowrl.loop(policy.generate, prompts, until="finished", max_turns=10, name="segment")

    settings = {
        "sample_per_episode": 8,
        "num_episode": 5,
        "train_global_batch_size": 4,
        "shuffle": True,
        "pipeline": {"backend": backend},
        **config,
        "staleness": {"max": max_staleness, "segment": segment, **config.get("staleness", {})},
    }
    built = flowrl.Engine(rollout=rollout, train=[learner], sync=[(learner, policy)], config=settings)
    built.set_dataset([{"response": [], "length": 1 + (i * 3) % 7} for i in range(16)])
    return built


def trained(run: flowrl.Engine) -> list[list[dict[str, Any]]]:
    """Per episode, per step: what the learner saw."""
    return [[r for step in episode["learner"] for r in step] for episode in run.train_results]
