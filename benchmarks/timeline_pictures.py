"""The timeline pictures of docs/observability.md: flowrl on the #209 scenario and on a
heavy-tail one (the load test's sleep workloads), a row per replica.

    python benchmarks/timeline_pictures.py          # writes docs/images/timeline-*.png and .json
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import ray

import flowrl._tools.scenarios as scen
from flowrl import open_pipeline
from flowrl._core.observe.trace import chrome_trace, write_json
from flowrl._tools.timeline_view import format_summary, render_png, summary

OUT = Path(__file__).resolve().parent.parent / "docs" / "images"
SHOWN = {
    "chatlearn-209": "ChatLearn #209: policy 2x4 feeding three 8x2 stages",
    "heavy-tail-256": "heavy tail: 256 samples, a few very long ones",
}


async def picture(name: str) -> None:
    w = scen.scenarios()[name]
    items = scen.items(w)
    async with open_pipeline(scen.workload_flow(w)) as pipe:
        await pipe.run(items[:8])  # warm-up: imports, first calls (left out of the picture)
        start = time.time()
        await pipe.run(items)
        spans = [s for s in pipe.timeline.spans if s.start >= start]
    write_json(OUT / f"timeline-{name}.json", chrome_trace(spans))
    render_png(spans, OUT / f"timeline-{name}.png", title=f"{SHOWN[name]} (white: idle)")
    length = max(s.end for s in spans) - min(s.start for s in spans)
    print(f"{name}:\n{format_summary(summary(spans), length)}\n")


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        for name in SHOWN:
            asyncio.run(picture(name))
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
