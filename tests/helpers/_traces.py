"""Reading Chrome traces in tests (shared by the pipeline and engine trace tests)."""

from __future__ import annotations

import itertools
from collections import defaultdict


def trace_tracks(trace: dict) -> dict[tuple[str, int], list[dict]]:
    """Complete events per (process name, thread id), in start order."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks[(names[e["pid"]], e["tid"])].append(e)
    return {k: sorted(v, key=lambda e: e["ts"]) for k, v in tracks.items()}


def assert_no_overlap(tracks: dict) -> None:
    for key, events in tracks.items():
        for a, b in itertools.pairwise(events):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (key, a, b)  # microseconds, rounded to 1 ns
