"""Per-sample random streams through a real pipeline: a sample draws the same numbers whatever
the replica count, the shard sizes, the finishing order and the backend; each turn of a loop
draws afresh; another run seed draws otherwise."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

import flowrl
from flowrl.testing import CountingTrainer

CPU = {"cpus_per_replica": 0.25}


class Dice(flowrl.Model):
    """Appends one draw from each sample's stream per turn; done after ``goal`` turns."""

    def __init__(self, name: str, config: dict[str, Any], jitter: int) -> None:
        super().__init__(name, config)
        self.jitter = jitter

    @flowrl.step
    def roll(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(random.Random(hash((self.jitter, *batch.ids.tolist()))).random() * 0.003)  # shuffled finishes
        draws = [torch.rand(1, generator=g).item() for g in batch.generators()]
        rolls = [[*r, d] for r, d in zip(batch["rolls"], draws, strict=True)]
        return {"rolls": rolls, "done": [len(r) >= g for r, g in zip(rolls, batch["goal"], strict=True)]}


def rolled(backend: str, replicas: int, batch: int, jitter: int, seed: int | None = None) -> list[list[float]]:
    dice = Dice("dice", {"num_replicas": replicas, "batch_size": batch, **CPU}, jitter)
    items = [{"rolls": [], "goal": 1 + i % 4} for i in range(24)]
    samples, _ = flowrl.run_flow(
        lambda x: flowrl.loop(dice.roll, x, until="done", max_turns=4),
        items,
        {"backend": backend, "inprocess_threads": True, "seed": seed},
    )
    return [s["rolls"] for s in samples]


def test_a_sample_draws_the_same_whatever_the_layout_and_the_backend(ray_cluster):
    reference = rolled("inprocess", 1, 4, jitter=0)
    assert [len(r) for r in reference] == [1 + i % 4 for i in range(24)]
    assert len({x for r in reference for x in r}) == sum(len(r) for r in reference)  # every turn draws afresh
    assert rolled("inprocess", 3, 2, jitter=1) == reference
    assert rolled("ray", 2, 3, jitter=2) == reference
    assert rolled("inprocess", 1, 4, jitter=0, seed=1) != reference


class Keeper(CountingTrainer):
    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"rolls": [list(r) for r in batch["rolls"]]}


def engine_rolls(seed: int, evaluate: bool = False) -> tuple[list[list[float]], list[list[float]]]:
    dice = Dice("dice", {"num_replicas": 2, "batch_size": 3, **CPU}, 0)
    keeper = Keeper("keeper", {**CPU})

    def flow(x: Any) -> Any:
        return flowrl.loop(dice.roll, x, until="done", max_turns=4)

    run = flowrl.Engine(
        rollout=flow,
        train=[keeper],
        eval_flow=flow if evaluate else None,
        config={
            "sample_per_episode": 6,
            "num_episode": 1,
            "seed": seed,
            "shuffle": False,
            "eval_every": 1 if evaluate else 0,
            "pipeline": {"backend": "inprocess"},
        },
    )
    items = [{"rolls": [], "goal": 2} for _ in range(6)]
    run.set_dataset(items)
    if evaluate:
        run.set_eval_dataset(items)
    run.learn()
    trained = sorted(r for step in run.train_results[0]["keeper"] for out in step for r in out["rolls"])
    evaluated = [s["rolls"] for s in run.eval_results[0]] if evaluate else []
    return trained, evaluated


def test_an_engine_seeds_the_streams_from_run_config_seed():
    first, evaluated = engine_rolls(0, evaluate=True)
    assert engine_rolls(0)[0] == first and engine_rolls(5)[0] != first
    # the evaluation's samples are numbered from 0 too: they draw from streams of their own
    assert not {x for r in evaluated for x in r} & {x for r in first for x in r}
