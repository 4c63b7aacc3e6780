"""Progress: a live view on a terminal, log lines elsewhere, for an engine's
episodes and a pipeline's runs.

``RunConfig.progress`` / ``PipelineConfig.progress``: ``"auto"`` draws a live table (rich)
when stderr is a terminal and otherwise logs a line per episode (or run) on the ``flowrl``
logger (at INFO: shown only where logging is set up to show it, so tests print nothing);
``"live"`` and ``"log"`` choose one; ``"off"`` neither. An engine's own pools stay quiet: its
view covers them.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

import anyio

if TYPE_CHECKING:
    from .._core.stats import PipelineStats
    from .inflight import Run

log = logging.getLogger("flowrl")
TICK_S = 0.25


class Watched(Protocol):
    """What a view reads of a pipeline."""

    def stats(self) -> PipelineStats: ...

    def busy(self) -> dict[str, tuple[int, int]]: ...


def mode(setting: str | bool) -> str:
    if isinstance(setting, bool):  # YAML's bare off / on
        return "live" if setting else "off"
    if setting == "auto":
        return "live" if sys.stderr.isatty() else "log"
    return setting


def episode_line(e: Any, total: int) -> str:
    """One line for an ``EpisodeStats``."""
    metrics = "; ".join(f"{t} " + " ".join(f"{k}={v:.4g}" for k, v in m.items()) for t, m in e.metrics.items() if m)
    return (
        f"episode {e.episode + 1}/{total}: {e.samples} samples; rollout {e.rollout_s:.2f} s, train {e.train_s:.2f} s, "
        f"sync {e.sync_s:.2f} s, eval {e.eval_s:.2f} s" + (f"; {metrics}" if metrics else "")
    )


class Progress:
    """The view of one ``learn()``: ``episode_done`` after each episode, ``watch`` while it runs."""

    def __init__(self, setting: str | bool, total: int, done: int = 0) -> None:
        self.mode = mode(setting)
        self.total = total
        self.started = time.perf_counter()
        self.episode = done  # episodes done before this learn() (a resumed run, an earlier call)
        self.base: dict[str, int] = {}
        self._live: Any = None

    def episode_done(self, stats: Any, pipe: Watched | None) -> None:
        self.episode = stats.episode + 1
        if pipe is not None:
            self.base = {name: s.samples for name, s in pipe.stats().stages.items()}
        if self.mode == "log":
            log.info(episode_line(stats, self.total))
        elif self.mode == "live" and self._live is not None:
            self._live.console.print(episode_line(stats, self.total))

    async def watch(self, pipe: Watched, per_episode: int) -> None:
        """Redraw the live table until cancelled."""
        if self.mode != "live":
            return
        self.base = {name: s.samples for name, s in pipe.stats().stages.items()}

        def title() -> str:
            elapsed = time.perf_counter() - self.started
            return f"episode {min(self.episode + 1, self.total)}/{self.total}, {elapsed:.1f} s"

        await live_view(lambda: stage_table(pipe, title(), self.base, per_episode), self)


async def live_view(render: Any, owner: Any = None) -> None:
    """Draw ``render()`` on stderr until cancelled; ``owner._live`` can print above it."""
    from rich.console import Console
    from rich.live import Live

    with Live(render(), console=Console(stderr=True), refresh_per_second=4, transient=True) as live:
        if owner is not None:
            owner._live = live
        try:
            while True:
                await anyio.sleep(TICK_S)
                live.update(render())
        finally:
            if owner is not None:
                owner._live = None


def stage_table(pipe: Watched, title: str, base: dict[str, int], of: int | None) -> Any:
    """A row per stage: samples done since ``base`` (of ``of``), replicas busy, queue."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("stage", "samples", "replicas busy", "queued (peak)"):
        table.add_column(column)
    busy = pipe.busy()
    for name, s in pipe.stats().stages.items():
        done = s.samples - base.get(name, 0)
        working, serving = busy[s.model]
        table.add_row(name, f"{done}/{of}" if of else str(done), f"{working}/{serving}", f"{s.queued} ({s.queue_peak})")
    return table


async def watch_run(pipe: Watched, run: Run, base: dict[str, int], scope: anyio.CancelScope) -> None:
    """A pipeline run's live view (until ``scope`` is cancelled)."""

    def render() -> Any:
        known = f"/{run.admitted}" if run.admission_done else f" of {run.admitted}+"
        title = f"run {run.index}: {run.finished}{known} samples, {time.perf_counter() - run.started:.1f} s"
        return stage_table(pipe, title, base, None)

    with scope:
        await live_view(render)


def run_line(pipe: Watched, run: Run, base: dict[str, int]) -> str:
    stages = ", ".join(f"{n} {s.samples - base.get(n, 0)}" for n, s in pipe.stats().stages.items())
    return f"run {run.index}: {run.finished} samples in {time.perf_counter() - run.started:.2f} s ({stages})"
