"""The staleness of a partial rollout's segments under asynchronous training (issue 23).

An engine trains on samples generated in segments (a ``flowrl.loop`` over a policy that writes at
most ``--segment`` tokens a call) with ``staleness.max`` 1: rollouts run ahead of training and
weight syncs land between shards, so one sample's segments may come from different weights.
Prints, per episode, the samples' staleness by their oldest segment (what the bound checks) and
every segment's, from ``EpisodeStats``, and how many segments each sample took.

    python benchmarks/partial_staleness.py --episodes 8
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import flowrl

CPU = {"cpus_per_replica": 0.25}


class Writer(flowrl.Model):
    """Writes at most ``segment`` tokens of each sample a call, ``token_s`` seconds a token of
    its longest row (decoding in lock step)."""

    def __init__(self, name: str, config: dict[str, Any], segment: int, token_s: float) -> None:
        super().__init__(name, config)
        self.segment, self.token_s = segment, token_s

    def set_weights(self, weights: Any) -> None:
        pass

    @flowrl.step
    def generate(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        written = [int(w) for w in batch["written"]]
        new = [min(self.segment, int(n) - w) for n, w in zip(batch["length"], written, strict=True)]
        time.sleep(self.token_s * max(new))
        total = [w + k for w, k in zip(written, new, strict=True)]
        return {"written": total, "finished": [t >= int(n) for t, n in zip(total, batch["length"], strict=True)]}


class Learner(flowrl.Model):
    def __init__(self, name: str, config: dict[str, Any], step_s: float) -> None:
        super().__init__(name, config)
        self.step_s = step_s

    def setup(self) -> None:
        self.steps = 0

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(self.step_s)
        self.steps += 1
        return {"samples": len(batch)}

    def get_weights(self) -> dict[str, Any]:
        return {"steps": np.array([self.steps])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--segment", type=int, default=64)
    p.add_argument("--backend", choices=["ray", "inprocess"], default="ray")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(96), 1.0, 256), 1, 1024).astype(int)
    writer = Writer("policy", {"num_replicas": 2, "batch_size": 8, **CPU}, args.segment, token_s=0.0005)
    learner = Learner("learner", CPU, step_s=0.25)

    def rollout(x: Any) -> Any:
        return flowrl.loop(writer.generate, x, until="finished", max_turns=64, name="segment")

    engine = flowrl.Engine(
        rollout=rollout,
        train=[learner],
        sync=[(learner, writer)],
        config={
            "sample_per_episode": 32,
            "num_episode": args.episodes,
            "train_global_batch_size": 16,
            "staleness": {"max": 1},
            "progress": "off",
            "pipeline": {"backend": args.backend},
        },
    )
    engine.set_dataset([{"written": 0, "length": int(n)} for n in lengths])
    stats = engine.learn()
    print("| episode | samples by their oldest segment (lag: samples) | every segment (lag: segments) | turns |")
    print("| --- | --- | --- | --- |")
    for e in stats.episodes:
        print(
            f"| {e.episode} | {e.staleness.get('policy', {})} | {e.segment_staleness.get('policy', {})} | "
            f"{e.turns.get('segment', {})} |"
        )
    behind = sum(n for e in stats.episodes for lag, n in e.segment_staleness.get("policy", {}).items() if lag > 0)
    total = sum(sum(e.segment_staleness.get("policy", {}).values()) for e in stats.episodes)
    print(f"\nsegments written by weights a version behind those trained: {behind} of {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
