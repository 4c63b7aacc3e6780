"""Progress of an engine's run (layer 6): a live view on a terminal, log lines elsewhere.

``RunConfig.progress``: ``"auto"`` draws a live table (rich) when stderr is a terminal and
otherwise logs a line per episode on the ``flowrl`` logger (at INFO: shown only where logging
is set up to show it, so tests print nothing); ``"live"`` and ``"log"`` choose one; ``"off"``
neither.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import anyio

from ._engine_parts import EpisodeStats
from ._runtime import AsyncPipeline

log = logging.getLogger("flowrl")
TICK_S = 0.25


def mode(setting: str) -> str:
    if setting == "auto":
        return "live" if sys.stderr.isatty() else "log"
    return setting


def episode_line(e: EpisodeStats, total: int) -> str:
    metrics = "; ".join(f"{t} " + " ".join(f"{k}={v:.4g}" for k, v in m.items()) for t, m in e.metrics.items() if m)
    return (f"episode {e.episode + 1}/{total}: {e.samples} samples; rollout {e.rollout_s:.2f} s, train {e.train_s:.2f} s, "
            f"sync {e.sync_s:.2f} s, eval {e.eval_s:.2f} s" + (f"; {metrics}" if metrics else ""))


class Progress:
    """The view of one ``learn()``: ``episode_done`` after each episode, ``watch`` while it runs."""

    def __init__(self, setting: str, total: int) -> None:
        self.mode = mode(setting)
        self.total = total
        self.started = time.perf_counter()
        self.episode = 0
        self.base: dict[str, int] = {}
        self._live: Any = None

    def episode_done(self, stats: EpisodeStats, pipe: AsyncPipeline | None) -> None:
        self.episode = stats.episode + 1
        if pipe is not None:
            self.base = {name: s.samples for name, s in pipe.stats().stages.items()}
        if self.mode == "log":
            log.info(episode_line(stats, self.total))
        elif self.mode == "live" and self._live is not None:
            self._live.console.print(episode_line(stats, self.total))

    async def watch(self, pipe: AsyncPipeline, per_episode: int) -> None:
        """Redraw the live table until cancelled."""
        if self.mode != "live":
            return
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        with Live(self._table(pipe, per_episode), console=console, refresh_per_second=4, transient=True) as live:
            self._live = live
            try:
                while True:
                    await anyio.sleep(TICK_S)
                    live.update(self._table(pipe, per_episode))
            finally:
                self._live = None

    def _table(self, pipe: AsyncPipeline, per_episode: int) -> Any:
        from rich.table import Table

        elapsed = time.perf_counter() - self.started
        table = Table(title=f"episode {min(self.episode + 1, self.total)}/{self.total}, {elapsed:.1f} s", title_justify="left")
        for column in ("stage", "samples this episode", "replicas busy"):
            table.add_column(column)
        busy = pipe.busy()
        for name, s in pipe.stats().stages.items():
            done = s.samples - self.base.get(name, 0)
            working, serving = busy[s.model]
            table.add_row(name, f"{done}/{per_episode}", f"{working}/{serving}")
        return table
