"""Reproducibility across layouts (issue 24; docs/reproducibility.md): ``examples/ppo_tiny.py``'s
six models with seed 0, in process, with several replica counts and shard sizes of the rollout's
models. Prints, per layout, whether the 30 episodes' mean rewards equal the first layout's as
floats, and whether the policy weights after the last episode (the synced weights in the last
checkpoint) are bitwise equal.

    python benchmarks/repro_layouts.py            # about 1-2 min on 2 cores
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import ppo_tiny  # noqa: E402
from ppo_tiny import Policy, PPOPolicy, PPOValue, Reference, Reward, Value  # noqa: E402

import flowrl  # noqa: E402

# (policy replicas, policy shard, reference/value replicas, their shard)
LAYOUTS = [(2, 16, 1, 32), (3, 5, 3, 7), (1, 64, 2, 8)]


def run(layout: tuple[int, int, int, int], episodes: int, folder: Path) -> tuple[list[float], str]:
    pr, pb, rr, rb = layout
    cpu = {"cpus_per_replica": 0.25}
    config = flowrl.RunConfig(
        sample_per_episode=64,
        num_episode=episodes,
        train_global_batch_size=32,
        train_micro_batch_size=16,
        num_training_epoch=4,
        shuffle=True,
        seed=0,
        checkpoint_dir=str(folder),
        checkpoint_every=episodes,
        progress="off",
        pipeline=flowrl.PipelineConfig(backend="inprocess"),
    )
    engine = flowrl.RLHFEngine(
        Policy("policy", {"num_replicas": pr, "batch_size": pb, **cpu}),
        Reference("reference", {"num_replicas": rr, "batch_size": rb, **cpu}),
        Reward("reward", {"num_replicas": 2, "batch_size": 16, **cpu}),
        Value("value", {"num_replicas": rr, "batch_size": rb, **cpu}),
        PPOPolicy("ppo_policy", {"num_replicas": 1, **cpu}),
        PPOValue("ppo_value", {"num_replicas": 1, **cpu}),
        config,
    )
    engine.set_dataset(ppo_tiny.dataset())
    curve = ppo_tiny.reward_curve(engine.learn())
    last = sorted(folder.glob("episode-*"))[-1]
    digest = hashlib.blake2b(b"".join(p.read_bytes() for p in sorted(last.glob("*synced*")))).hexdigest()[:16]
    return curve, digest


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=30)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, layout in enumerate(LAYOUTS):
            results.append(run(layout, args.episodes, Path(tmp, str(i))))
    (first, weights) = results[0]
    print("| layout (policy, reference/value: replicas x shard) | rewards equal | weights equal | last 3 |")
    print("| --- | --- | --- | --- |")
    for (pr, pb, rr, rb), (curve, digest) in zip(LAYOUTS, results, strict=True):
        same = f"{digest == weights} ({digest})"
        print(f"| {pr} x {pb}, {rr} x {rb} | {curve == first} | {same} | {sum(curve[-3:]) / 3:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
