"""Reading a timeline: the summary table and the utilisation chart of ``flowrl trace``.

The table's busy fractions are over the time after startup (the engine's span before its first
episode has a row of its own). The chart has a row per replica (and trainer rank), time across,
a bar per shard in its model's colour (hatched by stage when a model has several); the engine's
phases, startup included, run along the top in colours of their own (a long startup in a narrow
panel of its own), and every pool resize is a dashed line across all rows. Idle time is the
white between bars. It needs matplotlib (``pip install 'flowrl[plot]'``).

A model's colour comes from its name (a stable hash into ``PALETTE``), so a model keeps its
colour from run to run and in its evaluation pool; two names of one picture that hash to the
same or to a near colour are told apart by probing on, in name order: the same names always
give the same colours.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._core.errors import ConfigError
from .._core.observe.trace import ENGINE, Span, is_scale_event, lane_label

if TYPE_CHECKING:
    from collections.abc import Iterable

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# matplotlib refuses images taller than 2**16 pixels: 0.3 inch a row at 110 dpi allows ~1,980
MAX_CHART_ROWS = 1_000
STARTUP = "startup"  # the engine's span before its first episode
SPLIT = 1 / 3  # a startup longer than this share of the timeline gets a panel of its own
# 21 colours at least 26 apart in CIELAB (tab10, then the farthest of ColorBrewer's sets): the
# engine's phases take five, models the other sixteen, so a phase never looks like a model
PHASE_COLOURS = {
    STARTUP: "#7f7f7f",
    "rollout": "#393b79",
    "train": "#a6761d",
    "sync": "#1b9e77",
    "eval": "#637939",
}
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#fdc086",
    "#a1d99b",
    "#f0027f",
    "#decbe4",
    "#fb8072",
    "#e6ab02",
    "#fbb4ae",
)
SCALE_COLOUR = "#000000"  # resize lines: black and dashed, like no bar
HATCHES = ("", "//", "..", "xx", "\\\\", "oo", "++", "--")  # a model's stages, in name order


def model_of(group: str) -> str:
    """The model a timeline group belongs to: an evaluation pool's ``eval:policy`` is ``policy``."""
    return group.rpartition(":")[2]


def model_colours(models: Iterable[str]) -> dict[str, str]:
    """A colour per model name: its hash's slot of ``PALETTE``; in name order, a name whose slot an
    earlier name holds, or whose colour is near one held (CIE 1976 distance under ``FAR``), probes
    on to the next slot that is free and far, or else free: up to 6 names are all at least ``FAR``
    apart (any 5 such colours of the palette leave a sixth), 16 all distinct; more share."""
    out: dict[str, str] = {}
    taken: list[int] = []
    for name in sorted(set(models)):
        if len(taken) == len(PALETTE):
            taken.clear()  # every colour used once: the 17th name starts the palette again
        start = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") % len(PALETTE)
        free = [slot for i in range(len(PALETTE)) if (slot := (start + i) % len(PALETTE)) not in taken]
        slot = next((s for s in free if all(_DISTANCE[s][t] >= FAR for t in taken)), free[0])
        taken.append(slot)
        out[name] = PALETTE[slot]
    return out


def _lab(colour: str) -> tuple[float, float, float]:
    """``colour`` (#rrggbb, sRGB) in CIELAB (D65), where distance follows perceived difference."""
    rgb = [int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = (((c + 0.055) / 1.055) ** 2.4 if c > 0.04045 else c / 12.92 for c in rgb)
    xyz = (
        (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047,
        0.2126 * r + 0.7152 * g + 0.0722 * b,
        (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883,
    )
    fx, fy, fz = (t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


FAR = 45.0  # colours this far apart never pass for one another side by side (2.3 is just noticeable)
_DISTANCE = [[math.dist(_lab(a), _lab(b)) for b in PALETTE] for a in PALETTE]


def summary(spans: list[Span]) -> list[dict[str, object]]:
    """Per group (model, trainer, the engine's phases, ``autoscale``: the resizes): lanes, spans,
    samples, busy seconds and the busy fraction of its lanes after startup; first, where the engine
    recorded one, ``startup``: the time before the first episode, busy as its share of the whole
    timeline."""
    if not spans:
        return []
    start, end = min(s.start for s in spans), max(s.end for s in spans)
    length = max(end - start, 1e-9)
    rows: dict[str, dict[str, float]] = defaultdict(lambda: {"spans": 0, "samples": 0, "busy_s": 0.0})
    lanes: dict[str, set[int]] = defaultdict(set)
    for s in spans:
        group = STARTUP if s.group == ENGINE and s.name == STARTUP else s.group
        row = rows[group]
        row["spans"] += 1
        row["samples"] += int(s.args.get("samples", 0))
        row["busy_s"] += s.end - s.start
        lanes[group].add(s.lane)
    after = max(length - rows[STARTUP]["busy_s"], 1e-9) if STARTUP in rows else length
    out = []
    for group in sorted(rows, key=lambda g: (g != STARTUP, g != ENGINE, g)):
        row, n = rows[group], len(lanes[group])
        out.append(
            {
                "group": group,
                "lanes": n,
                "spans": int(row["spans"]),
                "samples": int(row["samples"]),
                "busy_s": round(row["busy_s"], 3),
                "busy": round(row["busy_s"] / (length if group == STARTUP else n * after), 3),
            }
        )
    return out


def format_summary(rows: list[dict[str, object]], length_s: float) -> str:
    """``rows`` as a table under a line that says what busy is measured over."""
    startup = next((float(str(r["busy_s"])) for r in rows if r["group"] == STARTUP), None)
    if startup is None:
        head = f"timeline of {length_s:.2f} s; busy = busy seconds / (lanes x {length_s:.2f} s)"
    else:
        after = length_s - startup
        head = (
            f"timeline of {length_s:.2f} s: startup {startup:.2f} s, then {after:.2f} s of episodes; "
            f"busy = busy seconds / (lanes x {after:.2f} s) (startup's: its share of the timeline)"
        )
    cols = ("group", "lanes", "spans", "samples", "busy_s", "busy")
    table = [cols] + [tuple(str(r[c]) for c in cols) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in table]
    return "\n".join([head, lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def render_png(spans: list[Span], path: str | Path, title: str = "") -> Path:
    """The utilisation chart of ``spans`` as a PNG."""
    path = Path(path)
    fig = draw_timeline(spans, title, where=str(path))
    try:
        fig.savefig(path, dpi=110)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return path


def draw_timeline(spans: list[Span], title: str = "", where: str = "the chart") -> Figure:
    """The utilisation chart of ``spans`` as a matplotlib Figure (closed by the caller): its bars
    carry the gid ``bars:<group>[<lane>]:<span name>``, its resize lines ``scale:<span name>``.
    A startup longer than ``SPLIT`` of the timeline gets a narrow panel of its own on the left, so
    the episodes keep the width they need (the last panel is the episodes')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [s for s in spans if not is_scale_event(s)]
    tracks = sorted({(s.group, s.lane) for s in bars}, key=lambda t: (t[0] != ENGINE, t[0], t[1]))
    if len(tracks) > MAX_CHART_ROWS:
        raise ConfigError(
            f"{where}: the chart would have {len(tracks)} rows (replicas and ranks), more than {MAX_CHART_ROWS} "
            "fit in a PNG; --no-png prints the summary only"
        )
    origin = min(s.start for s in spans)
    length = max(max(s.end for s in spans) - origin, 1e-6)
    startup = max((s.end - origin for s in bars if s.group == ENGINE and s.name == STARTUP), default=0.0)
    panels = [(0.0, startup), (startup, length)] if SPLIT * length < startup < length else [(0.0, length)]
    fig, axes = plt.subplots(
        1,
        len(panels),
        sharey=True,
        squeeze=False,
        figsize=(12, 1.4 + 0.3 * max(len(tracks), 1)),
        width_ratios=[1, 4][-len(panels) :],
        layout="constrained",  # makes room for the legend above the panels
    )
    styles = _styles(bars)
    events = [s for s in spans if is_scale_event(s)]
    for ax, (low, high) in zip(axes[0], panels, strict=True):
        _draw_bars(ax, bars, tracks, origin, styles)
        shown = [e for e in events if low <= e.start - origin < high or high == length]
        _draw_scale_events(ax, shown, origin, high - low)
        ax.set_xlim(low, high)
        ax.set_axisbelow(True)
        ax.grid(axis="x", alpha=0.3)
    first = axes[0][0]
    first.set_yticks(range(len(tracks)))
    first.set_yticklabels([lane_label(g, lane) for g, lane in reversed(tracks)], fontsize=8)
    first.set_ylim(-0.6, max(len(tracks), 1) - 0.4)
    axes[0][-1].set_xlabel("seconds")
    fig.suptitle(title or "busy time per replica (white: idle)", fontsize=10)
    _legend(fig, styles, len(events))
    return fig


Style = tuple[str, str]  # face colour, hatch


def _styles(bars: list[Span]) -> dict[tuple[str, str], Style]:
    """(model or ``engine``, span name) -> its style: a phase's colour, or its model's colour with a
    hatch per stage (the first stage of a model plain)."""
    stages: dict[str, set[str]] = defaultdict(set)
    for s in bars:
        if s.group != ENGINE:
            stages[model_of(s.group)].add(s.name)
    colours = model_colours(stages)
    out: dict[tuple[str, str], Style] = {
        (ENGINE, n): (PHASE_COLOURS.get(n, "#c7c7c7"), "") for n in {s.name for s in bars if s.group == ENGINE}
    }
    for model, names in stages.items():
        for i, name in enumerate(sorted(names)):
            out[(model, name)] = (colours[model], HATCHES[i % len(HATCHES)])
    return out


def _draw_bars(
    ax: Axes, bars: list[Span], tracks: list[tuple[str, int]], origin: float, styles: dict[tuple[str, str], Style]
) -> None:
    row = {t: len(tracks) - 1 - i for i, t in enumerate(tracks)}
    runs: dict[tuple[str, int, str], list[tuple[float, float]]] = defaultdict(list)
    for s in bars:
        runs[(s.group, s.lane, s.name)].append((s.start - origin, max(s.end - s.start, 1e-6)))
    for (group, lane, name), xs in runs.items():
        colour, hatch = styles[(group if group == ENGINE else model_of(group), name)]
        collection = ax.broken_barh(
            xs, (row[(group, lane)] - 0.4, 0.8), facecolors=colour, edgecolor=_edge(colour), linewidth=0.6, hatch=hatch
        )
        collection.set_gid(f"bars:{group}[{lane}]:{name}")
        collection.set_zorder(2)


def _edge(colour: str) -> str:
    """A darker shade of ``colour``: the outline that keeps a bar narrower than a pixel visible, and
    a pale one distinct from the white of idle time."""
    return "#" + "".join(f"{int(int(colour[i : i + 2], 16) * 0.7):02x}" for i in (1, 3, 5))


def _draw_scale_events(ax: Axes, events: list[Span], origin: float, width: float) -> None:
    """A dashed line across every row per resize, above the bars, labelled with what changed; the
    resizes within 1% of the panel's ``width`` of each other share one label (theirs would overlap)."""
    groups: list[list[Span]] = []
    for s in sorted(events, key=lambda s: s.start):
        ax.axvline(s.start - origin, color=SCALE_COLOUR, linestyle="--", linewidth=1.2, zorder=5, gid=f"scale:{s.name}")
        if groups and s.start - groups[-1][0].start <= 0.01 * width:
            groups[-1].append(s)
        else:
            groups.append([s])
    for group in groups:
        ax.text(
            group[0].start - origin,
            0.98,
            " " + "; ".join(map(_scale_label, group)),
            transform=ax.get_xaxis_transform(),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            zorder=6,
            clip_on=True,
            gid="scale-label:" + "; ".join(s.name for s in group),
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )


def _scale_label(s: Span) -> str:
    before, after = s.args.get("before"), s.args.get("after")
    return s.name if before is None or after is None else f"{s.name} {before}→{after}"


def _legend(fig: Figure, styles: dict[tuple[str, str], Style], scales: int) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    handles: list[Any] = []
    labels: list[str] = []
    by_model: dict[str, list[str]] = defaultdict(list)
    for model, name in sorted(k for k in styles if k[0] != ENGINE):
        by_model[model].append(name)
    for model, names in by_model.items():
        for name in names:
            colour, hatch = styles[(model, name)]
            handles.append(
                Rectangle((0, 0), 1, 1, facecolor=colour, hatch=hatch, edgecolor=_edge(colour), linewidth=0.6)
            )
            labels.append(model if len(names) == 1 else f"{model}: {name.rpartition('.')[2]}")
    phases = [p for p in PHASE_COLOURS if (ENGINE, p) in styles]
    phases += sorted(n for g, n in styles if g == ENGINE and n not in PHASE_COLOURS)
    for phase in phases:
        handles.append(Rectangle((0, 0), 1, 1, facecolor=styles[(ENGINE, phase)][0], linewidth=0))
        labels.append(phase)
    if scales:
        handles.append(Line2D([0], [0], color=SCALE_COLOUR, linestyle="--", linewidth=1.2))
        labels.append("resize")
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 8), fontsize=8, frameon=False)
