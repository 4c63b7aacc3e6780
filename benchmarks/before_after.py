"""The load test of two commits, side by side on this machine: a change's cost in one run.

    python benchmarks/before_after.py BEFORE [AFTER] [--rounds 2] [--scenario tiny-shards ...]

Each commit is exported (``git archive``) to a folder of its own (a folder given instead of a
commit is used as it is: where there is no git, as on the lent machine) and run from there
(``PYTHONPATH``; Ray's workers inherit it), alternating before, after, before, after, so that
the machine's drift falls on both. Prints, per scenario, flowrl's makespan in each round, the
ratio of the medians, and static push over flowrl; then the substrate (shards per second).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def export(rev: str, into: Path) -> Path:
    if Path(rev).is_dir():
        return Path(rev).resolve()
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    return into


def run(tree: Path, out: Path, scenarios: list[str], repeats: int) -> dict[str, Any]:
    picked = [a for s in scenarios for a in ("--scenario", s)]
    cmd = ["python", "-m", "flowrl", "loadtest", "--repeats", str(repeats), "--no-ray-data", "--out", str(out), *picked]
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True)
    report: dict[str, Any] = json.loads(out.with_suffix(".json").read_text())
    return report


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    def rows(side: str, scenario: str, key: str) -> list[float]:
        return [
            r["flowrl"]["makespan_s"] if key == "flowrl" else r[key]
            for report in runs[side]
            for r in report["rows"]
            if r["scenario"] == scenario
        ]

    lines = [
        "| scenario | before flowrl s | after flowrl s | after/before | before flowrl/bound | after flowrl/bound "
        "| before push/flowrl | after push/flowrl |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in runs["before"][0]["rows"]:
        s = row["scenario"]
        b, a = rows("before", s, "flowrl"), rows("after", s, "flowrl")
        ratio = statistics.median(a) / statistics.median(b)
        pb, pa = rows("before", s, "push_over_flowrl"), rows("after", s, "push_over_flowrl")
        bb, ba = rows("before", s, "flowrl_over_bound"), rows("after", s, "flowrl_over_bound")
        fmt = " / ".join
        lines.append(
            f"| {s} | {fmt(f'{x:.3f}' for x in b)} | {fmt(f'{x:.3f}' for x in a)} | {ratio:.3f} | "
            f"{fmt(f'{x:.3f}' for x in bb)} | {fmt(f'{x:.3f}' for x in ba)} | "
            f"{fmt(f'{x:.2f}' for x in pb)} | {fmt(f'{x:.2f}' for x in pa)} |"
        )
    shards = {side: " / ".join(f"{r['raw']['flowrl_shards_per_s']:.0f}" for r in runs[side]) for side in runs}
    lines += ["", f"substrate, flowrl no-op shards per second: before {shards['before']}, after {shards['after']}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", default="HEAD")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenario", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {side: export(rev, Path(tmp) / side) for side, rev in (("before", args.before), ("after", args.after))}
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for i in range(args.rounds):
            for side, tree in trees.items():
                runs[side].append(run(tree, Path(tmp) / f"{side}-{i}.md", args.scenario, args.repeats))
                print(f"round {i + 1}: {side} done", flush=True)
    print(f"\n{args.before} -> {args.after}, {args.rounds} rounds of {args.repeats} repeats (medians each)\n")
    print(table(runs))


if __name__ == "__main__":
    main()
