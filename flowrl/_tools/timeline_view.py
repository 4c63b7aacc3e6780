"""Reading a timeline: the summary table and the utilisation chart of ``flowrl trace``.

The chart has a row per replica (and trainer rank), time across, a bar per shard coloured by
stage; the engine's phases run along the top. Idle time is the white between bars. It needs
matplotlib (``pip install 'flowrl[plot]'``).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .._core.errors import ConfigError
from .._core.trace import ENGINE, Span

# matplotlib refuses images taller than 2**16 pixels: 0.3 inch a row at 110 dpi allows ~1,980
MAX_CHART_ROWS = 1_000
PHASE_COLOURS = {"rollout": "#4c72b0", "train": "#dd8452", "sync": "#55a868", "eval": "#8172b3"}


def summary(spans: list[Span]) -> list[dict[str, object]]:
    """Per group (model, trainer, or the engine's phases): lanes, spans, samples, busy seconds
    and the busy fraction of its lanes over the whole timeline."""
    if not spans:
        return []
    start, end = min(s.start for s in spans), max(s.end for s in spans)
    length = max(end - start, 1e-9)
    rows: dict[str, dict[str, float]] = defaultdict(lambda: {"spans": 0, "samples": 0, "busy_s": 0.0})
    lanes: dict[str, set[int]] = defaultdict(set)
    for s in spans:
        row = rows[s.group]
        row["spans"] += 1
        row["samples"] += int(s.args.get("samples", 0))
        row["busy_s"] += s.end - s.start
        lanes[s.group].add(s.lane)
    out = []
    for group in sorted(rows, key=lambda g: (g != ENGINE, g)):
        row, n = rows[group], len(lanes[group])
        out.append(
            {
                "group": group,
                "lanes": n,
                "spans": int(row["spans"]),
                "samples": int(row["samples"]),
                "busy_s": round(row["busy_s"], 3),
                "busy": round(row["busy_s"] / (n * length), 3),
            }
        )
    return out


def format_summary(rows: list[dict[str, object]], length_s: float) -> str:
    head = f"timeline of {length_s:.2f} s; busy = busy seconds / (lanes x {length_s:.2f} s)"
    cols = ("group", "lanes", "spans", "samples", "busy_s", "busy")
    table = [cols] + [tuple(str(r[c]) for c in cols) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in table]
    return "\n".join([head, lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def render_png(spans: list[Span], path: str | Path, title: str = "") -> Path:
    """The utilisation chart of ``spans`` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    origin = min(s.start for s in spans)
    tracks = sorted({(s.group, s.lane) for s in spans}, key=lambda t: (t[0] != ENGINE, t[0], t[1]))
    if len(tracks) > MAX_CHART_ROWS:
        raise ConfigError(
            f"{path}: the chart would have {len(tracks)} rows (replicas and ranks), more than {MAX_CHART_ROWS} "
            "fit in a PNG; --no-png prints the summary only"
        )
    row = {t: len(tracks) - 1 - i for i, t in enumerate(tracks)}
    names = sorted({s.name for s in spans if s.group != ENGINE})
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    colour = {n: cmap(i % cmap.N) for i, n in enumerate(names)} | PHASE_COLOURS
    fig, ax = plt.subplots(figsize=(12, 1.4 + 0.3 * len(tracks)))
    by_track: dict[tuple[str, int], list[tuple[float, float, str]]] = defaultdict(list)
    for s in spans:
        by_track[(s.group, s.lane)].append((s.start - origin, max(s.end - s.start, 1e-6), s.name))
    for track, bars in by_track.items():
        ax.broken_barh(
            [(x, w) for x, w, _ in bars],
            (row[track] - 0.4, 0.8),
            facecolors=[colour.get(n, "grey") for _, _, n in bars],
            linewidth=0,
        )
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([("phases" if g == ENGINE else f"{g}[{lane}]") for g, lane in reversed(tracks)], fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_xlim(0, max(s.end for s in spans) - origin)
    handles = [
        Rectangle((0, 0), 1, 1, color=colour[n])
        for n in [*names, *(p for p in PHASE_COLOURS if any(s.name == p for s in spans))]
    ]
    labels = [*names, *(p for p in PHASE_COLOURS if any(s.name == p for s in spans))]
    ax.legend(
        handles,
        labels,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        ncol=min(len(labels), 6),
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(title or "busy time per replica (white: idle)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
