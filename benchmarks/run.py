"""Run the CPU benchmarks and write their tables to a dated result file.

    python benchmarks/run.py                 # every scenario, 3 repeats (medians)
    python benchmarks/run.py --repeats 1 --scenario chatlearn-209

Writes ``benchmarks/results/<date>-cpu<N>-run.md``, where N is the machine's CPU count, and the
load test's JSON beside it (``--out`` puts them elsewhere). The file holds the load test
(``flowrl loadtest``), the simulator at scale (``sim_scaling.py``) and big payloads
(``payload.py``). docs/benchmarks.md shows the current tables, each with its command, and what
the numbers say; it is written by hand from these files.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))

import payload  # noqa: E402
import sim_scaling  # noqa: E402

from flowrl._tools.loadtest import loadtest_main  # noqa: E402


def default_out() -> Path:
    day = datetime.date.today().isoformat()
    return Path(__file__).resolve().parent / "results" / f"{day}-cpu{os.cpu_count()}-run.md"


if __name__ == "__main__":
    scaling = sim_scaling.section()  # first, while no Ray process competes for the CPU
    args = sys.argv[1:] if "--out" in sys.argv else [*sys.argv[1:], "--out", str(default_out())]
    code = loadtest_main(args, command="python benchmarks/run.py")
    if code == 0 and "--list" not in args:
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
        try:
            extra = payload.section()
        finally:
            ray.shutdown()
        with open(args[args.index("--out") + 1], "a") as f:
            f.write("\n" + scaling + "\n" + extra)
    sys.exit(code)
