"""The engine's view of a ``learn()``: a live table on a terminal (the episode, its phase, the
pace and what is left; the rollout's stages and the trainers' ranks; the last episode's
metrics), or a line per episode; and the one line a Ctrl-C leaves. The pieces it shares with a
pipeline's runs (modes, where lines go, the stage and start-up tables) are in
``_pipeline/progress.py``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .._pipeline.progress import duration, live_view, mode, say, stage_table

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._pipeline.progress import Watched

# per trainer: (ranks in a train call now, ranks, samples trained so far)
TrainerRows = dict[str, tuple[int, int, int]]

# How a run resumes, in the stop line: a script is run again as it was; `flowrl run`, which
# makes a new run folder each time, sets this to point at the command it prints after the line.
RESUME_HOW = "resume with the same command (RunConfig.checkpoint.resume='auto')"


def stopped_line(done: int, total: int, checkpoint: Any, checkpoint_dir: str | None, resume: str = "auto") -> str:
    """The one line a Ctrl-C leaves: where the run stopped and how to go on from there (the same
    command resumes only where it says ``resume="auto"``)."""
    where = f"flowrl: stopped at episode {min(done + 1, total)} of {total} ({done} done)"
    if checkpoint is not None and resume == "auto":
        return f"{where}; last checkpoint {checkpoint}; {RESUME_HOW}"
    if checkpoint is not None:
        how = f"resume with RunConfig.checkpoint.resume='auto' (this run has {resume!r})"
        return f"{where}; last checkpoint {checkpoint}; {how}"
    if checkpoint_dir:
        return f"{where}; no checkpoint written yet in {checkpoint_dir}, so nothing to resume"
    return f"{where}; nothing to resume (set RunConfig.checkpoint.dir and checkpoint.every to write checkpoints)"


def metrics_text(metrics: dict[str, dict[str, float]]) -> str:
    """A trainer's mean metrics, ``ppo_policy loss=0.1 score=0.5; ppo_value ...``."""
    return "; ".join(f"{t} " + " ".join(f"{k}={v:.4g}" for k, v in m.items()) for t, m in metrics.items() if m)


def episode_line(e: Any, total: int) -> str:
    """One line for an ``EpisodeStats``."""
    metrics = metrics_text(e.metrics)
    return (
        f"episode {e.episode + 1}/{total}: {e.samples} samples; rollout {e.rollout_s:.2f} s, train {e.train_s:.2f} s, "
        f"sync {e.sync_s:.2f} s, eval {e.eval_s:.2f} s" + (f"; {metrics}" if metrics else "")
    )


def pace(done: int, first: int, total: int, elapsed: float) -> tuple[float | None, float | None]:
    """Episodes per second over this ``learn()`` (``first`` were done before it) and the seconds
    left at that pace; ``None`` before its first episode ends."""
    if done <= first or elapsed <= 0:
        return None, None
    rate = (done - first) / elapsed
    return rate, max(0, total - done) / rate


def title(done: int, first: int, total: int, elapsed: float, phase: str) -> str:
    """The live view's title: the episode under way, its phase, the pace and what is left."""
    head = f"episode {min(done + 1, total)}/{total} · {phase} · {duration(elapsed)}"
    rate, left = pace(done, first, total, elapsed)
    if rate is None or left is None:
        return head
    return f"{head} · {rate:.3g} episodes/s · ETA {duration(left)}"


class Progress:
    """The view of one ``learn()``: ``phase`` as an episode goes, ``episode_done`` after each,
    ``watch`` while it runs. ``trainers`` reads the trainer rows (see ``TrainerRows``)."""

    def __init__(
        self, setting: str | bool, total: int, done: int = 0, trainers: Callable[[], TrainerRows] | None = None
    ) -> None:
        self.mode = mode(setting)
        self.total = total
        self.started = time.perf_counter()
        self.first = done  # episodes done before this learn() (a resumed run, an earlier call)
        self.episode = done
        self.phase = "rollout"
        self.last: dict[str, dict[str, float]] = {}  # the last episode's mean train metrics
        self.base: dict[str, int] = {}
        self.trainers = trainers or dict
        self.trained = {name: row[2] for name, row in self.trainers().items()}  # at the episode's start
        self._live: Any = None

    def say(self, line: str) -> None:
        """A line for the user: above the live view, or as a log line."""
        if self.mode == "live" and self._live is not None:
            self._live.console.print(line, markup=False, highlight=False)  # a metric named "x[0]" is no markup
        elif self.mode in ("live", "log"):
            say(line)

    def episode_done(self, stats: Any, pipe: Watched | None) -> None:
        self.episode = stats.episode + 1
        self.phase = "rollout"  # the next episode's, or waiting for one that ran ahead
        self.last = stats.metrics
        self.trained = {name: row[2] for name, row in self.trainers().items()}
        if pipe is not None:
            self.base = {name: s.samples for name, s in pipe.stats().stages.items()}
        self.say(episode_line(stats, self.total))

    def title(self) -> str:
        return title(self.episode, self.first, self.total, time.perf_counter() - self.started, self.phase)

    def render(self, pipe: Watched, per_episode: int) -> Any:
        from rich.console import Group
        from rich.text import Text

        parts: list[Any] = [Text(self.title(), style="bold"), stage_table(pipe, None, self.base, per_episode)]
        rows = self.trainers()
        if rows:
            parts.append(trainer_table(rows, self.trained))
        if self.last:
            parts.append(Text(f"last episode: {metrics_text(self.last)}"))
        return Group(*parts)

    async def watch(self, pipe: Watched, per_episode: int) -> None:
        """Redraw the live view until cancelled."""
        if self.mode != "live":
            return
        self.base = {name: s.samples for name, s in pipe.stats().stages.items()}
        await live_view(lambda: self.render(pipe, per_episode), self)


def trainer_table(rows: TrainerRows, base: dict[str, int]) -> Any:
    """A row per trainer: its ranks in a train step now, samples trained this episode."""
    from rich.table import Table

    table = Table()
    for column in ("trainer", "ranks busy", "samples trained this episode"):
        table.add_column(column)
    for name, (busy, ranks, samples) in rows.items():
        table.add_row(name, f"{busy}/{ranks}", str(samples - base.get(name, 0)))
    return table
