"""Reproducibility across layouts (issue 24; docs/reproducibility.md): ``examples/ppo_tiny.py``'s
six models with seed 0, in process, with several replica counts and shard sizes of the rollout's
models. Prints, per layout, whether the 30 episodes' mean rewards equal the first layout's as
floats, and whether the trainers' models after the last episode (the last checkpoint's
``*.model.msgpack`` files: the policy and value trainers) are bitwise equal.

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

# (policy replicas, policy shard, reference/value replicas, their shard)
LAYOUTS = [(2, 16, 1, 32), (3, 5, 3, 7), (1, 64, 2, 8)]


def run(layout: tuple[int, int, int, int], episodes: int, folder: Path) -> tuple[list[float], str]:
    engine = ppo_tiny.make_engine(
        episodes,
        "inprocess",
        1,
        seed=0,
        rollout=layout,
        checkpoint_dir=str(folder),
        checkpoint_every=episodes,
        progress="off",
    )
    curve = ppo_tiny.reward_curve(engine.learn())
    last = sorted(folder.glob("episode-*"))[-1]
    files = sorted(last.glob("*.model.msgpack"))  # each trainer's model as saved
    if not files:
        raise SystemExit(f"no trainer model files in {last}")
    digest = hashlib.blake2b(b"".join(p.read_bytes() for p in files)).hexdigest()[:16]
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
