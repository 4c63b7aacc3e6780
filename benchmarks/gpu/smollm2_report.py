"""The table of docs/hf.md's GPU runs of examples/grpo_smollm2.py, from what
benchmarks/gpu/run.sh seeds leaves in a folder: per seed its summary (seed-N.json) and
nvidia-smi's samples (smi-N.csv: timestamp, utilization %, memory MiB, every 0.2 s).

    python benchmarks/gpu/smollm2_report.py FOLDER      # prints a Markdown table

Per seed: held-out accuracy before and after training, seconds per episode (rollout, train,
sync: the mean over episodes after the first, which also warms up), generated tokens per
second of rollout, and the GPU's utilization while the rollouts ran (nvidia-smi, median and
mean of the samples inside the rollout windows)."""

from __future__ import annotations

import json
import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any


def smi_samples(path: Path) -> list[tuple[float, float]]:
    """(Unix time, utilization %) of each nvidia-smi line (its timestamps are local time)."""
    out = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[1].isdigit():
            out.append((datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(parts[1])))
    return out


def busy_in(samples: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[float]:
    return [u for t, u in samples if any(a <= t <= b for a, b in windows)]


def row(summary: dict[str, Any], samples: list[tuple[float, float]]) -> str:
    episodes = summary["episodes"]
    steady = episodes[1:] or episodes

    def mean(key: str) -> float:
        return statistics.fmean(e[key] for e in steady)

    tokens = sum(e["tokens"] for e in episodes) / sum(e["rollout_s"] for e in episodes)
    busy = busy_in(samples, [tuple(e["rollout_window"]) for e in episodes if e["rollout_window"]])
    gpu = f"{statistics.median(busy):.0f} / {statistics.fmean(busy):.0f} ({len(busy)})" if busy else "no samples"
    after = " -> ".join(f"{a:.3f}" for a in summary["after"])
    return (
        f"| {summary['seed']} | {summary['before']:.3f} | {after} | {len(episodes)} | {mean('rollout_s'):.2f} | "
        f"{mean('train_s'):.2f} | {mean('sync_s'):.3f} | {tokens:,.0f} | {gpu} | {summary['wall_s']:.0f} |"
    )


def main(folder: str) -> int:
    root = Path(folder)
    seeds = sorted(root.glob("seed-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if not seeds:
        print(f"no seed-*.json in {root}", file=sys.stderr)
        return 1
    print(
        "| seed | held-out before | after (each evaluation) | episodes | rollout s | train s | sync s "
        "| tokens/s (rollout) | GPU busy % in rollouts, median / mean (samples) | wall s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in seeds:
        smi = root / f"smi-{path.stem.split('-')[1]}.csv"
        print(row(json.loads(path.read_text()), smi_samples(smi) if smi.exists() else []))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
