"""The CPU driver: the load test and what goes with it, on this machine.

    python benchmarks/run.py                 # every scenario, 3 repeats (medians)
    python benchmarks/run.py --repeats 1 --scenario chatlearn-209
    python benchmarks/run.py before-after BEFORE [AFTER] [--rounds 2] [--repeats 3] [--scenario tiny-shards ...]
    python benchmarks/run.py seeds 0 1 2 3   # examples/grpo_smollm2.py once per seed; mean +- std
    python benchmarks/run.py chaos [--episodes 100] [--kills 25] [--gap-s 0.5] [--seed 0]

Without a subcommand it writes ``benchmarks/results/<date>-cpu<N>-run.md``, where N is the
machine's CPU count, and the load test's JSON beside it (``--out`` puts them elsewhere); every
argument goes to the load test (``python -m flowrl loadtest``, whose options it takes). The file
holds the load test, the simulator at scale (``sim_scaling.py``) and big payloads
(``payload.py``). docs/benchmarks.md shows the current tables, each with its command, and what
the numbers say; it is written by hand from these files.

``before-after``: the load test of two commits, side by side on this machine: a change's cost in
one run. Each commit is exported (``git archive``) to a folder of its own (a folder given instead
of a commit is used as it is: where there is no git, as on the lent machine) and run from there
(``PYTHONPATH``; Ray's workers inherit it), alternating before, after, before, after, so that the
machine's drift falls on both. Prints, per scenario, flowrl's makespan in each round, the ratio
of the medians, and static push over flowrl; then the substrate (shards per second).

``seeds``: examples/grpo_smollm2.py once per seed, one after the other (on CPUs), then held-out
accuracy as mean +- sample std over the seeds. Each run's JSON summary, log and resident memory
(VmRSS every 10 s) go to ``--out`` (default $OUT, else runs/seeds).

``chaos``: an engine whose actors a thread kills at random times, against the same run without
kills (``chaos.py``); the table of docs/reliability.md and a results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def default_out() -> Path:
    day = datetime.date.today().isoformat()
    return HERE / "results" / f"{day}-cpu{os.cpu_count()}-run.md"


def loadtest(argv: list[str]) -> int:
    """The load test, the simulator at scale and big payloads, to one dated file."""
    import ray

    sys.path.insert(0, str(HERE))
    import payload
    import sim_scaling

    from flowrl._tools.loadtest import loadtest_main

    scaling = sim_scaling.section()  # first, while no Ray process competes for the CPU
    args = argv if "--out" in argv else [*argv, "--out", str(default_out())]
    code = loadtest_main(args, command="python benchmarks/run.py")
    if code == 0 and "--list" not in args:
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
        try:
            extra = payload.section()
        finally:
            ray.shutdown()
        with open(args[args.index("--out") + 1], "a") as f:
            f.write("\n" + scaling + "\n" + extra)
    return code


# before-after


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


def loadtest_in(tree: Path, out: Path, scenarios: list[str], repeats: int) -> dict[str, Any]:
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


def before_after(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/run.py before-after", description="the load test of two commits, side by side"
    )
    parser.add_argument("before", help="a commit, or a folder holding a checkout")
    parser.add_argument("after", nargs="?", default="HEAD", help="the same (default HEAD)")
    parser.add_argument("--rounds", type=int, default=2, help="before, after, ... this many times")
    parser.add_argument("--repeats", type=int, default=3, help="the load test's repeats a round")
    parser.add_argument("--scenario", action="append", default=[], help="only these scenarios")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {side: export(rev, Path(tmp) / side) for side, rev in (("before", args.before), ("after", args.after))}
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for i in range(args.rounds):
            for side, tree in trees.items():
                runs[side].append(loadtest_in(tree, Path(tmp) / f"{side}-{i}.md", args.scenario, args.repeats))
                print(f"round {i + 1}: {side} done", flush=True)
    print(f"\n{args.before} -> {args.after}, {args.rounds} rounds of {args.repeats} repeats (medians each)\n")
    print(table(runs))
    return 0


# seeds


def vmrss_kb(pid: int) -> str:
    """The process's resident size in kB from /proc, or "" once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""
    return next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")), "")


def one_seed(seed: str, out: Path) -> None:
    cmd = [sys.executable, str(ROOT / "examples" / "grpo_smollm2.py"), "--seed", seed]
    cmd += ["--summary", str(out / f"seed-{seed}.json"), "--run-dir", str(out / f"run-{seed}")]
    log = out / f"seed-{seed}.log"
    with open(log, "w") as f, open(out / f"rss-{seed}.txt", "a") as rss:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            rss.write(f"{int(time.time())} {vmrss_kb(proc.pid)}\n")
            rss.flush()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    lines = log.read_text(errors="replace").splitlines()
    print(f"seed {seed}: rc={proc.returncode} {lines[-1] if lines else ''}", flush=True)


def spread(name: str, values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    listed = ", ".join(f"{v:.3f}" for v in values)
    return f"{name}: {statistics.fmean(values):.3f} +- {sd:.3f} over {len(values)} runs ({listed})"


def seeds(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/run.py seeds", description="examples/grpo_smollm2.py once per seed, on CPUs"
    )
    parser.add_argument("seeds", nargs="+", metavar="SEED")
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT", "runs/seeds")), help="$OUT, else runs/seeds"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        one_seed(seed, args.out)
    found = [args.out / f"seed-{s}.json" for s in args.seeds]
    runs = [json.loads(p.read_text()) for p in found if p.exists()]
    print(spread("before", [r["before"] for r in runs]))
    for i in range(min(len(r["after"]) for r in runs)):
        print(spread(f"after episode {(i + 1) * runs[0]['eval_every']}", [r["after"][i] for r in runs]))
    print(spread("wall s", [r["wall_s"] for r in runs]))
    return 0


def chaos(argv: list[str]) -> int:
    sys.path.insert(0, str(HERE))
    import chaos as driver  # (beside this file; imports flowrl, which the other subcommands need not)

    code: int = driver.main(argv)
    return code


SUBCOMMANDS = {"before-after": before_after, "seeds": seeds, "chaos": chaos}


def main(argv: list[str]) -> int:
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    return loadtest(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
