"""Chaos: an engine in deterministic mode whose policy, scorer and trainer processes are killed
at points drawn from a seed ends with bitwise the same trained weights and the same per-episode
results as the same run without faults; every sample is counted once and the pools are back at
their size. Real Ray actors; deaths are the processes exiting (``os._exit``), replacements and
trainer rebuilds are flowrl's own.

Each call of a model draws, from (seed, model, replica, call), whether its process dies now;
marker files created exclusively bound the deaths per model (they also count them). The short
run is in the default suite; the long one (more episodes and kills) is behind ``-m slow``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl.testing import flowrl_actor_names

torch = pytest.importorskip("torch")

CPU = {"cpus_per_replica": 0.1}
PER_EPISODE = 8


def claim_death(marks: str, limit: int) -> bool:
    """True for at most ``limit`` calls over every process: each takes a marker of its own."""
    for i in range(limit):
        try:
            os.close(os.open(Path(marks, f"death-{i}"), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            continue
    return False


class Chaotic(flowrl.Model):
    """Dies, now and then, as its seed says, until its model's deaths are spent."""

    def __init__(self, name: str, config: Any, chaos: dict[str, Any]) -> None:
        super().__init__(name, config)
        self.chaos = chaos

    def maybe_die(self) -> None:
        c = self.chaos
        self.calls = getattr(self, "calls", 0) + 1
        draw = random.Random(f"{c['seed']}/{self.name}/{self.replica_id}/{self.calls}").random()
        if c["limit"] and draw < c["p"] and claim_death(c["marks"], c["limit"]):
            os._exit(1)


class Policy(Chaotic):
    """``y = w.x`` plus noise from each sample's own stream (the same draw on any replica)."""

    def setup(self) -> None:
        torch.manual_seed(1)  # every replica starts from the same weights, as a real policy loads them
        self.module = torch.nn.Linear(4, 1)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self.maybe_die()
        x = torch.as_tensor(np.asarray(batch["x"], dtype=np.float32))
        with torch.no_grad():
            y = self.module(x).squeeze(1).numpy()
        noise = [rng.normal() for rng in batch.rngs()]
        return {"y": [float(v + 0.1 * n) for v, n in zip(y, noise, strict=True)]}


class Scorer(Chaotic):
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self.maybe_die()
        return {"score": [1.0 - min((float(y) - 1.0) ** 2, 4.0) for y in batch["y"]]}


class Trainer(Chaotic):
    """Fits ``Linear(4, 1)`` to the scores; reports its weights, exactly."""

    def setup(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.01)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self.maybe_die()
        x = torch.as_tensor(np.asarray(batch["x"], dtype=np.float32))
        target = torch.as_tensor(np.asarray(batch["score"], dtype=np.float32))
        loss = (self.module(x).squeeze(1) - target).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss), "w": self.module.weight.detach().flatten().tolist()}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def restore_state(self, state: Any) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])


def run(tmp: Path, episodes: int, deaths: dict[str, int], seed: int) -> dict[str, Any]:
    """One run; ``deaths``: the most kills per model (all 0: the calm run)."""

    def chaos(model: str) -> dict[str, Any]:
        marks = tmp / f"deaths-{model}"
        marks.mkdir(parents=True, exist_ok=True)
        return {"seed": seed, "p": 0.3, "marks": str(marks), "limit": deaths.get(model, 0)}

    policy = Policy("policy", {"num_replicas": 2, "batch_size": 2, **CPU}, chaos("policy"))
    scorer = Scorer("scorer", {"num_replicas": 2, "batch_size": 1, **CPU}, chaos("scorer"))
    trainer = Trainer("trainer", {**CPU}, chaos("trainer"))
    engine = flowrl.Engine(
        rollout=lambda x: scorer.forward_step(policy.forward_step(x)),
        train=[trainer],
        sync=[(trainer, policy)],
        config={
            "sample_per_episode": PER_EPISODE,
            "num_episode": episodes,
            "seed": seed,
            "progress": "off",
            "reproducibility": {"deterministic": True},
            "checkpoint": {"dir": str(tmp / "checkpoints"), "every": 1, "max_trainer_restarts": 10},
            "pipeline": {"max_retries": 10},
        },
    )
    engine.set_dataset([{"x": np.linspace(-1, 1, 4, dtype=np.float32) * (i % 5)} for i in range(40)])
    with engine:
        engine.learn()
        rollout = engine._session.deployment.rollout
        engine._portal.call(rollout.healed)
        serving = {m: len(rollout.serving(m)) for m in ("policy", "scorer")}
        stats = engine.stats()  # with the replacements that started after the last episode
    results = [list(episode["trainer"]) for episode in engine.train_results]
    killed = {m: len(list((tmp / f"deaths-{m}").iterdir())) for m in ("policy", "scorer", "trainer")}
    return {"results": results, "stats": stats, "serving": serving, "killed": killed}


def check_same_as_calm(tmp_path: Path, episodes: int, deaths: dict[str, int], seed: int) -> dict[str, int]:
    calm = run(tmp_path / "calm", episodes, {}, seed)
    chaotic = run(tmp_path / "chaos", episodes, deaths, seed)
    assert calm["killed"] == {"policy": 0, "scorer": 0, "trainer": 0}
    losses = [step[0]["loss"] for episode in calm["results"] for step in episode]
    assert all(np.isfinite(losses)), losses  # a run that diverged would compare nan with nan
    assert chaotic["results"] == calm["results"]  # every loss and weight, bit for bit
    recovered = chaotic["stats"]
    for model in ("policy", "scorer"):  # each death replaced once, its time measured
        times = [e.recovery_s for e in recovered.replaced if e.model == model]
        assert len(times) == chaotic["killed"][model] and all(t is not None and t >= 0 for t in times)
    assert len(recovered.rebuilds) == chaotic["killed"]["trainer"]
    assert all(r.trainer == "trainer" and r.rank == 0 and r.seconds > 0 for r in recovered.rebuilds)
    assert calm["stats"].replaced == calm["stats"].rebuilds == []
    for r in (calm, chaotic):
        stages = r["stats"].rollout.stages
        assert stages["policy.forward_step"].samples == stages["scorer.forward_step"].samples
        assert r["serving"] == {"policy": 2, "scorer": 2}  # the pools back at their size
        assert [e.episode for e in r["stats"].episodes] == list(range(episodes))
    assert flowrl_actor_names() == []
    return chaotic["killed"]


def test_a_run_with_kills_ends_bit_for_bit_where_a_calm_run_ends(ray_cluster, tmp_path):
    killed = check_same_as_calm(tmp_path, 4, {"policy": 2, "scorer": 2, "trainer": 1}, seed=7)
    assert killed["policy"] + killed["scorer"] >= 2, killed  # the draws did kill (p=0.3 over dozens of calls)


@pytest.mark.slow
def test_a_long_run_with_many_kills_ends_bit_for_bit_where_a_calm_run_ends(ray_cluster, tmp_path):
    killed = check_same_as_calm(tmp_path, 10, {"policy": 10, "scorer": 10, "trainer": 3}, seed=11)
    assert sum(killed.values()) >= 20, killed
