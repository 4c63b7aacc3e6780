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
    sys.exit(loadtest_main([*sys.argv[1:], "--out", out] if "--out" not in sys.argv else sys.argv[1:]))
