"""Record and replay of an asynchronous schedule (issue 24; docs/reproducibility.md):
``examples/ppo_tiny.py`` with ``max_staleness=1``, each run recording the weight version of
every rollout sample. Per repeat: a plain asynchronous run (recorded), a second plain run (does
timing give the same split?), a replay of the first run's record with the same layout (what
replaying costs), and one with another layout of the rollout's replicas. Prints each run's wall
time, how many samples were a version behind, and whether the trainers' final models are
bitwise equal to the first run's.

    python benchmarks/replay_cost.py --backend ray --repeats 3      # about 3 min on 2 cores
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import ppo_tiny  # noqa: E402


def run(folder: Path, backend: str, episodes: int, **extra: object) -> tuple[float, str, int]:
    """Wall seconds of ``learn()``, a hash of the trainers' final models, samples a version behind."""
    record = folder / "schedule.jsonl"
    engine = ppo_tiny.make_engine(
        episodes,
        backend,
        2 if backend == "ray" else 1,
        checkpoint_dir=str(folder),
        checkpoint_every=episodes,
        max_staleness=1,
        record_schedule=str(record),
        progress="off",
        **extra,
    )
    with engine:  # the actors' start-up is not timed
        started = time.perf_counter()
        engine.learn()
        wall = time.perf_counter() - started
    last = sorted(folder.glob("episode-*"))[-1]
    digest = hashlib.blake2b(b"".join(p.read_bytes() for p in sorted(last.glob("*.model.msgpack"))), digest_size=8)
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    behind = sum(v < e["episode"] for e in lines for r in e["runs"] for v in r["versions"]["policy"])
    return wall, digest.hexdigest(), behind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="inprocess", choices=["inprocess", "ray"])
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"recorded": [], "again": [], "replayed": [], "replayed, 3x5/3x7": []}
    print("| repeat | run | wall s | samples a version behind | final models (blake2b) | equal to the recorded |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            first = run(root / "a", args.backend, args.episodes)
            again = run(root / "b", args.backend, args.episodes)
            record = str(root / "a" / "schedule.jsonl")
            replayed = run(root / "c", args.backend, args.episodes, replay_schedule=record)
            other = run(root / "d", args.backend, args.episodes, rollout=(3, 5, 3, 7), replay_schedule=record)
            for name, (wall, digest, behind) in zip(times, (first, again, replayed, other), strict=True):
                times[name].append(wall)
                print(f"| {k} | {name} | {wall:.2f} | {behind} | {digest} | {digest == first[1]} |")
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(
        f"\nmedians over {args.repeats}: "
        + ", ".join(f"{n} {m:.2f} s" for n, m in medians.items())
        + f"; replayed / recorded {medians['replayed'] / medians['recorded']:.2f}"
    )


if __name__ == "__main__":
    main()
