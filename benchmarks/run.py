"""Run every benchmark and write docs/benchmarks.md (and the load test's JSON beside it).

    python benchmarks/run.py                 # every scenario, 3 repeats (medians)
    python benchmarks/run.py --repeats 1 --scenario chatlearn-209

The load test is ``flowrl loadtest --out docs/benchmarks.md``; the simulator at scale
(``sim_scaling.py``), big payloads (``payload.py``), the sections of the benchmarks run on
their own (``sections/*.md``: asynchronous training, autoscaling, loops; each written from its
script's latest run) and what the numbers say (``notes.md``, written by hand) are appended to
the same page.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))

import payload  # noqa: E402
import sim_scaling  # noqa: E402

from flowrl._tools.loadtest import loadtest_main  # noqa: E402

if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    scaling = sim_scaling.section()  # first, while no Ray process competes for the CPU
    args = sys.argv[1:] if "--out" in sys.argv else [*sys.argv[1:], "--out", str(out)]
    code = loadtest_main(args, command="python benchmarks/run.py")
    if code == 0 and "--list" not in args:
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
        try:
            extra = payload.section()
        finally:
            ray.shutdown()
        with open(args[args.index("--out") + 1], "a") as f:
            here = Path(__file__).parent
            sections = "".join(p.read_text() for p in sorted((here / "sections").glob("*.md")))
            f.write("\n" + scaling + "\n" + extra + "\n" + sections + (here / "notes.md").read_text())
    sys.exit(code)
