"""Progress: a live view on a terminal, log lines elsewhere, for an engine's startup and a
pipeline's runs; the engine's view of its episodes builds on these pieces
(``_engine/engine_view.py``).

``RunConfig.progress`` / ``PipelineConfig.progress``: ``"auto"`` draws a live view (rich) when
stderr is a terminal and otherwise writes a line per episode; ``"live"`` and ``"log"`` choose
one; ``"off"`` neither. An engine's lines go to the ``flowrl.progress`` logger at INFO; when
the application has configured no logging handler, flowrl prints them on stderr itself, so a
plain script shows them (configure logging, or set ``progress="off"``, to route or silence
them). A pipeline's run lines go to the ``flowrl`` logger only. An engine's own pools stay
quiet: its view covers them.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import TYPE_CHECKING, Any, Protocol

import anyio

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import TracebackType

    from .._backends.specs import ActorCounts
    from .._core.observe.pipeline_stats import PipelineStats
    from .inflight import Run

log = logging.getLogger("flowrl")
lines = logging.getLogger("flowrl.progress")
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


def say(line: str) -> None:
    """``line`` on the ``flowrl.progress`` logger, or on stderr where nobody configured logging
    (Python would drop an INFO record there, and a run would look silent)."""
    if lines.hasHandlers():
        lines.info(line)
    elif lines.level in (logging.NOTSET, logging.DEBUG, logging.INFO):  # a level set by hand silences it
        tell(f"flowrl: {line}")


def tell(line: str) -> None:
    """``line`` on stderr, now (a library's own output: no print)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


# sys.excepthook before ours; the KeyboardInterrupt whose line was told
_previous_hook: list[Any] = []
_told: list[BaseException] = []


def _quiet_hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if not any(value is told for told in _told):
        _previous_hook[0](kind, value, tb)


def interrupted(line: str) -> KeyboardInterrupt:
    """Tell ``line`` and return the KeyboardInterrupt to raise instead of the one caught (its
    chain is the cancelled tasks' tracebacks: some 80 lines that would bury the message). A
    script that does not catch it ends with that line alone: the hook below prints no traceback
    for it, and Python still exits as killed by SIGINT (it checks for KeyboardInterrupt itself,
    not a subclass, so this is one)."""
    tell(line)
    if sys.excepthook is not _quiet_hook:  # the application's hook still sees every other error
        _previous_hook[:] = [sys.excepthook]
        sys.excepthook = _quiet_hook
    err = KeyboardInterrupt()
    _told[:] = [err]
    return err


def duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, s = divmod(seconds, 60)
    return f"{minutes} min {s:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


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


def stage_table(pipe: Watched, title: str | None, base: dict[str, int], of: int | None) -> Any:
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


def startup_table(counts: ActorCounts, elapsed: float) -> Any:
    """A row per model: actors ready of those asked for; placement groups in the title."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    ready, expected = sum(counts.ready.values()), sum(counts.expected.values())
    head = f"starting actors: {ready}/{expected} ready · {duration(elapsed)}"
    if counts.groups:
        head += f" · placement groups reserved {len(counts.reserved)}/{len(counts.groups)}"
    table = Table()
    for column in ("model", "actors ready"):
        table.add_column(column)
    for name, want in counts.expected.items():
        table.add_row(name, f"{counts.ready.get(name, 0)}/{want}")
    return Group(Text(head, style="bold"), table)


def startup_line(counts: ActorCounts) -> str:
    expected = sum(counts.expected.values())
    models = ", ".join(f"{name} {n}" for name, n in counts.expected.items())
    n = len(counts.groups)
    groups = f", {n} placement group{'s' * (n != 1)}" if n else ""
    return f"starting {expected} actors for {len(counts.expected)} models ({models}{groups}) ..."


@contextlib.contextmanager
def showing_startup(setting: str | bool, counts: ActorCounts) -> Iterator[None]:
    """Show the actors starting while the block runs (a live table, or a line before and one
    after); ``counts.expect`` must have been called. The table is redrawn by rich's own thread:
    the block enters task groups that outlive it (the pools'), so no task of ours may wrap it."""
    shown, started = mode(setting), time.perf_counter()
    if shown == "log":
        say(startup_line(counts))
    with contextlib.ExitStack() as stack:
        if shown == "live":
            from rich.console import Console
            from rich.live import Live

            def render() -> Any:
                return startup_table(counts, time.perf_counter() - started)

            live = Live(get_renderable=render, console=Console(stderr=True), refresh_per_second=4, transient=True)
            stack.enter_context(live)
        yield
    if shown in ("live", "log"):
        ready = sum(counts.ready.values())
        say(f"{ready} actors of {len(counts.expected)} models ready in {time.perf_counter() - started:.1f} s")


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
