"""Run the load-test scenarios side by side and write docs/benchmarks.md (and a JSON report).

    python benchmarks/run.py                 # every scenario, 3 repeats (medians)
    python benchmarks/run.py --repeats 1 --scenario chatlearn-209

The same as ``flowrl loadtest --out docs/benchmarks.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from flowrl._loadtest import loadtest_main

if __name__ == "__main__":
    out = str(Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md")
    args = sys.argv[1:] if "--out" in sys.argv else [*sys.argv[1:], "--out", out]
    sys.exit(loadtest_main(args, command="python benchmarks/run.py"))
