"""Chaos from outside: an engine in deterministic mode on a local Ray cluster while a thread of
the driver kills its policy, scorer and trainer actors (``ray.kill``) at random times drawn
from a seed, against the same run without kills. Writes
``benchmarks/results/<date>-cpu<N>-chaos.json`` and prints the table of docs/reliability.md.

    python benchmarks/run.py chaos [--episodes 100] [--kills 25] [--gap-s 0.5] [--seed 0]

The kills land wherever the run is: in a shard, between shards, in a weight sync, in a
checkpoint. What is checked: the trained weights and every per-episode loss bit for bit equal
to the calm run's, every sample trained once (the trainer's counts), the pools back at their
size; what is measured: each kill's recovery (a replica: from the death noticed to its
replacement serving; a trainer: to its ranks restored from the last checkpoint).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import flowrl

PER_EPISODE, MODELS = 8, ("policy", "scorer", "trainer")
CPU = {"cpus_per_replica": 0.1}
# kills come far faster than in life and hit replacements still starting: more of them in a row
# than Healing's default 3 before a replica is left out
HEALING = {"healing": {"max_restarts": 10, "backoff_s": 0.5}}
STEP_S = 0.05  # each call sleeps this long, so that an episode lasts long enough to be hit


class Policy(flowrl.Model):
    """``y = w.x`` plus noise from each sample's own stream (the same draw on any replica)."""

    def setup(self) -> None:
        self.w = np.full(4, 0.5)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(STEP_S)
        noise = [rng.normal() for rng in batch.rngs()]
        return {"y": [float(self.w @ np.asarray(x)) + 0.1 * n for x, n in zip(batch["x"], noise, strict=True)]}

    def set_weights(self, weights: Any) -> None:
        self.w = np.asarray(weights["w"])

    def get_weights(self) -> dict[str, Any]:  # its starting weights, kept for a rebuild before the first sync
        return {"w": self.w.copy()}


class Scorer(flowrl.Model):
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(STEP_S)
        return {"score": [1.0 - min((float(y) - 1.0) ** 2, 4.0) for y in batch["y"]]}


class Trainer(flowrl.Model):
    """Least squares of ``w.x`` on the scores, one SGD step a batch; reports ``w`` exactly."""

    def setup(self) -> None:
        self.w = np.full(4, 0.5)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(STEP_S)
        x, target = np.asarray(batch["x"]), np.asarray(batch["score"])
        error = x @ self.w - target
        self.w = self.w - 0.01 * 2 * x.T @ error / len(target)
        return {"loss": float(np.mean(error**2)), "w": self.w.tolist()}

    def get_weights(self) -> dict[str, Any]:
        return {"w": self.w.copy()}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"w": self.w.tolist()}

    def restore_state(self, state: Any) -> None:
        self.w = np.asarray(state["w"])


ACTOR = re.compile(r"flowrl-[0-9a-f]+-(policy|scorer|trainer)-\d+(-\d+)?")  # a rebuilt rank: -<generation>


def model_of(actor: str) -> str:
    """``flowrl-<run>-<model>-<replica>[-<generation>]`` -> ``<model>`` (one of ``MODELS``, else "")."""
    found = ACTOR.fullmatch(actor)
    return found.group(1) if found else ""


class Killer(threading.Thread):
    """Kills ``kills`` actors of ``MODELS``, one every ``gap_s`` seconds on average (exponential
    gaps), each of a kind chosen at random among those alive, from ``seed`` (a replacement
    or a rebuilt rank still starting may be hit too)."""

    def __init__(self, seed: int, kills: int, gap_s: float) -> None:
        super().__init__(daemon=True)
        self.rng, self.kills, self.gap_s = random.Random(seed), kills, gap_s
        self.stop, self.done = threading.Event(), []  # (seconds into the run, actor)

    def run(self) -> None:
        import ray

        from flowrl.testing import flowrl_actor_names

        start = time.monotonic()
        while len(self.done) < self.kills and not self.stop.wait(self.rng.expovariate(1 / self.gap_s)):
            alive = [a for a in flowrl_actor_names() if model_of(a)]
            if not alive:
                continue
            kind = self.rng.choice(sorted({model_of(a) for a in alive}))  # each kind alike, whatever its size
            victim = self.rng.choice([a for a in alive if model_of(a) == kind])
            try:
                ray.kill(ray.get_actor(victim, namespace="flowrl"), no_restart=True)
            except ValueError:  # gone meanwhile (stopped, or replaced)
                continue
            self.done.append((round(time.monotonic() - start, 2), victim))


def run(folder: Path, episodes: int, seed: int, killer: Killer | None) -> dict[str, Any]:
    policy = Policy("policy", {"num_replicas": 2, "batch_size": 2, **CPU, **HEALING})
    scorer = Scorer("scorer", {"num_replicas": 2, "batch_size": 1, **CPU, **HEALING})
    trainer = Trainer("trainer", {**CPU})
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
            "checkpoint": {"dir": str(folder / "checkpoints"), "every": 1, "max_trainer_restarts": 100},
            "pipeline": {"max_retries": 20},
        },
    )
    engine.set_dataset([{"x": np.linspace(-1, 1, 4) * (i % 5)} for i in range(40)])
    started = time.monotonic()
    with engine:
        if killer is not None:
            killer.start()
        try:
            engine.learn()
        finally:
            if killer is not None:
                killer.stop.set()
                killer.join()
        rollout = engine._session.deployment.rollout  # noqa: SLF001 - the driver reads the pools' size
        engine._portal.call(rollout.healed)  # noqa: SLF001
        serving = {m: len(rollout.serving(m)) for m in ("policy", "scorer")}
        stats = engine.stats()
    return {
        "seconds": time.monotonic() - started,
        "results": [list(e["trainer"]) for e in engine.train_results],
        "trained": stats.trainers["trainer"].samples,
        "serving": serving,
        "replaced": {m: [e.recovery_s for e in stats.replaced if e.model == m] for m in ("policy", "scorer")},
        "rebuilds": [r.seconds for r in stats.rebuilds],
        "redone": sum(r.redone for r in stats.rebuilds),
        "kills": killer.done if killer is not None else [],
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} / {max(values):.2f}" if values else "-"


def table(calm: dict[str, Any], chaos: dict[str, Any], episodes: int) -> str:
    same = chaos["results"] == calm["results"]
    expected = episodes * PER_EPISODE
    by_kind = {m: sum(model_of(a) == m for _, a in chaos["kills"]) for m in MODELS}
    times = {**chaos["replaced"], "trainer": chaos["rebuilds"]}
    head = "| kind | kills | recoveries | recovery s (median / max) | samples lost | trained twice | weights as calm |"
    lost, twice = max(expected - chaos["trained"], 0), max(chaos["trained"] - expected, 0)
    rows = [
        f"| {m} | {by_kind[m]} | {len(times[m])} | {spread(times[m])} | {lost} | {twice} | {'yes' if same else 'NO'} |"
        for m in MODELS
    ]
    return "\n".join([head, "| --- " * 7 + "|", *rows])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--kills", type=int, default=25)
    parser.add_argument("--gap-s", type=float, default=0.5, help="mean seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import tempfile

    import ray

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            calm = run(Path(tmp, "calm"), args.episodes, args.seed, None)
            chaos = run(Path(tmp, "chaos"), args.episodes, args.seed, Killer(args.seed, args.kills, args.gap_s))
    finally:
        ray.shutdown()
    ok = (
        chaos["results"] == calm["results"]
        and chaos["trained"] == calm["trained"] == args.episodes * PER_EPISODE
        and chaos["serving"] == calm["serving"] == {"policy": 2, "scorer": 2}
    )
    date = datetime.date.today().isoformat()
    out = args.out or Path(__file__).parent / "results" / f"{date}-cpu{os.cpu_count()}-chaos.json"
    command = "python benchmarks/run.py chaos " + " ".join(argv)
    summary = {"command": command.strip(), "ok": ok, "episodes": args.episodes, "calm": calm, "chaos": chaos}
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(table(calm, chaos, args.episodes))
    print(f"calm {calm['seconds']:.1f} s, with kills {chaos['seconds']:.1f} s ({chaos['redone']} episodes redone)")
    print(f"{'passed' if ok else 'FAILED'}; {out}")
    return 0 if ok else 1
