"""``RunConfig.reproducibility.deterministic`` in an engine: the rollout's shards are fixed blocks of each
episode's sample ids whatever the layout and the backend, trainer ranks run torch's
deterministic algorithms, and what cannot run deterministically is refused when the engine is
built."""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest
import torch

import flowrl
from flowrl.testing import CountingTrainer

CPU = {"cpus_per_replica": 0.25}


class Shards(flowrl.Model):
    """Records, per sample, the ids of the shard it ran in."""

    @flowrl.step
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        ids = batch.ids.tolist()
        time.sleep(random.Random(hash(tuple(ids))).random() * 0.003)  # workload: finishing order varies
        return {"shard": [ids] * len(ids)}


class Keeper(CountingTrainer):
    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"shards": [list(s) for s in batch["shard"]], "det": torch.are_deterministic_algorithms_enabled()}


def engine(backend: str, replicas: int, deterministic: bool = True, **model: Any) -> flowrl.Engine:
    shards = Shards("shards", {"num_replicas": replicas, "batch_size": 4, **CPU, **model})
    return flowrl.Engine(
        rollout=shards.forward_step,
        train=[Keeper("keeper", {**CPU})],
        config={
            "sample_per_episode": 10,
            "num_episode": 2,
            "shuffle": False,
            "reproducibility": {"deterministic": deterministic},
            "pipeline": {"backend": backend, "inprocess_threads": True},
        },
    )


def learned(backend: str, replicas: int) -> tuple[list[tuple[int, ...]], list[bool]]:
    """The rollout's shards over both episodes, and each train step's torch flag."""
    e = engine(backend, replicas)
    e.set_dataset([{"p": i} for i in range(10)])
    e.learn()
    outs = [out for episode in e.train_results for step in episode["keeper"] for out in step]
    return sorted({tuple(s) for out in outs for s in out["shards"]}), [out["det"] for out in outs]


def test_an_engine_cuts_each_episode_into_blocks_and_its_trainer_runs_deterministic_algorithms(ray_cluster):
    before = torch.are_deterministic_algorithms_enabled()
    try:
        shards, flags = learned("inprocess", 3)
    finally:
        torch.use_deterministic_algorithms(before)  # in process it is the whole process's setting
    # two episodes of 10 samples (ids 0-9, 10-19): blocks of 4 from each episode's first id
    assert shards == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9), (10, 11, 12, 13), (14, 15, 16, 17), (18, 19)]
    assert flags and all(flags)
    on_ray, flags = learned("ray", 2)
    assert on_ray == shards
    assert flags and all(flags)


def test_what_cannot_run_deterministically_is_refused_when_the_engine_is_built():
    with pytest.raises(
        flowrl.ConfigError, match=r"RunConfig.reproducibility.deterministic=True with model 'shards'.*on_spent='drop'"
    ):
        engine("inprocess", 1, on_spent="drop")
    engine("inprocess", 1, deterministic=False, on_spent="drop")  # without it, built
    only = engine("inprocess", 1, deterministic=False)
    config = msgspec.structs.replace(
        only.config, pipeline=msgspec.structs.replace(only.config.pipeline, deterministic=True)
    )
    shards = Shards("shards", {"num_replicas": 1, "batch_size": 4, **CPU, "on_spent": "drop"})
    with pytest.raises(flowrl.ConfigError, match=r"RunConfig.pipeline.deterministic=True with model 'shards'"):
        flowrl.Engine(rollout=shards.forward_step, train=[Keeper("keeper", {**CPU})], config=config)
