"""The chaos run's models and driver (imported by engine/test_chaos.py and by its node-loss script):
policy, scorer and trainer processes that die at points drawn from a seed.

Each call of a model draws, from (seed, model, replica, call), whether its process dies now;
marker files created exclusively bound the deaths per model (they also count them)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import flowrl

if TYPE_CHECKING:
    from collections.abc import Callable

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


def run(
    tmp: Path,
    episodes: int,
    deaths: dict[str, int],
    seed: int,
    *,
    gpus: bool = False,
    colocate: bool = False,
    ranks: int = 1,
    staleness: int = 0,
    deterministic: bool = True,
    schedule: dict[str, str] | None = None,
    during: Callable[[flowrl.Engine], Callable[[], None]] | None = None,
) -> dict[str, Any]:
    """One run; ``deaths``: the most kills per model (all 0: the calm run). ``gpus``: each policy
    and scorer replica asks for a (logical) GPU, in its pool's placement group, or with
    ``colocate`` in one group for both (a policy and a scorer replica on each GPU).
    ``ranks``: the trainer's data-parallel ranks (with two, a rank killed at the start of a step
    is rebuilt from its peer's state); ``staleness``: ``RunConfig.staleness.max``;
    ``deterministic``: its reproducibility mode (off: shards are cut by timing, and only counts
    can be compared); ``schedule``: ``record_schedule``
    or ``replay_schedule`` (``RunConfig.reproducibility``). ``during(engine)`` is called once the
    engine has started, and what it returns once its run has ended (a node loss starts and
    stops so)."""

    def chaos(model: str) -> dict[str, Any]:
        marks = tmp / f"deaths-{model}"
        marks.mkdir(parents=True, exist_ok=True)
        return {"seed": seed, "p": 0.3, "marks": str(marks), "limit": deaths.get(model, 0)}

    # kills come far faster than in life (ten a pool within a minute, a node loss beside them, and
    # replacements start side by side): more than Healing's defaults allow before leaving one out
    pool = {**CPU, "healing": {"max_restarts": 10, "per_minute": 30}} | ({"gpus_per_replica": 1} if gpus else {})
    policy = Policy("policy", {"num_replicas": 2, "batch_size": 2, **pool}, chaos("policy"))
    scorer = Scorer("scorer", {"num_replicas": 2, "batch_size": 1, **pool}, chaos("scorer"))
    trainer = Trainer("trainer", {"num_replicas": ranks, **CPU}, chaos("trainer"))
    engine = flowrl.Engine(
        rollout=lambda x: scorer.forward_step(policy.forward_step(x)),
        train=[trainer],
        sync=[(trainer, policy)],
        config={
            "sample_per_episode": PER_EPISODE,
            "num_episode": episodes,
            "seed": seed,
            "progress": "off",
            "reproducibility": {"deterministic": deterministic, **(schedule or {})},
            "staleness": {"max": staleness},
            "checkpoint": {"dir": str(tmp / "checkpoints"), "every": 1, "max_trainer_restarts": 10},
            "pipeline": {"max_retries": 10},
            "colocation": [["policy", "scorer"]] if colocate else [],
        },
    )
    engine.set_dataset([{"x": np.linspace(-1, 1, 4, dtype=np.float32) * (i % 5)} for i in range(40)])
    with engine:
        stop = during(engine) if during is not None else None
        try:
            engine.learn()
        finally:
            if stop is not None:
                stop()
        rollout = engine._session.deployment.rollout
        engine._portal.call(rollout.healed)
        serving = {m: len(rollout.serving(m)) for m in ("policy", "scorer")}
        stats = engine.stats()  # with the replacements that started after the last episode
    results = [list(episode["trainer"]) for episode in engine.train_results]
    killed = {m: len(list((tmp / f"deaths-{m}").iterdir())) for m in ("policy", "scorer", "trainer")}
    return {"results": results, "stats": stats, "serving": serving, "killed": killed}


def facts(r: dict[str, Any], episodes: int) -> dict[str, Any]:
    """What the chaos tests check of one run (``run``'s result), as plain values."""
    stats = r["stats"]
    stages = stats.rollout.stages
    return {
        "killed": r["killed"],
        "serving": r["serving"],
        "recovery_s": {m: [e.recovery_s for e in stats.replaced if e.model == m] for m in ("policy", "scorer")},
        "rebuilds": [[b.trainer, b.rank, b.seconds, b.source] for b in stats.rebuilds],
        "both_stages_saw_each_sample": stages["policy.forward_step"].samples == stages["scorer.forward_step"].samples,
        "episodes_in_order": [e.episode for e in stats.episodes] == list(range(episodes)),
        "trained": stats.trainers["trainer"].samples,
    }


def summary(calm: dict[str, Any], chaotic: dict[str, Any], episodes: int) -> dict[str, Any]:
    """What the chaos tests check of a calm run and a run with faults, as plain values (the
    node-loss script prints them for its test)."""
    losses = [step[0]["loss"] for episode in calm["results"] for step in episode]
    return {
        "finite": bool(np.all(np.isfinite(losses))),  # a run that diverged would compare nan with nan
        "same": chaotic["results"] == calm["results"],  # every loss and weight, bit for bit
        "calm": facts(calm, episodes),
        "chaos": facts(chaotic, episodes),
    }
