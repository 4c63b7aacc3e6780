"""What an engine reports: its run directory, and metrics for Ray's Prometheus export.

``metrics.jsonl``: one JSON object per episode (its ``EpisodeStats``, the trainers' and the
rollout pipeline's counters so far, the wall-clock time), each episode once: an engine's first
line drops the lines of that episode and later ones (a run resumed from a checkpoint redoes
them, a fresh run into the same folder starts again at 0, and a trainer rebuilt from a
checkpoint redoes them too); the file as the earlier run left it stays beside, as
``metrics.jsonl.1`` (``.2``, ... : never over an earlier one), and a line says so; ``trace.json``: the timeline of every
replica, trainer rank and episode phase as a Chrome trace (``flowrl trace RUN_DIR`` renders it).
``metric_values``: the same counters as gauges (``flowrl_*``; Ray prefixes ``ray_``), which the
Ray backend exports through ``ray.util.metrics`` after every episode.
``live.json``: the marker of the run under way (``LiveRun``), there only while a ``learn()`` runs;
``flowrl scale`` binds its request to it. The files others may plant here (a FIFO, a symlink to
/dev/zero) are read with ``read_regular``, which never blocks on what is not a regular file.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, BinaryIO

import msgspec

from .._core.errors import ConfigError, FlowError
from .._core.observe.trace import Span, chrome_trace
from .._pipeline.progress import say

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .._core.observe.pipeline_stats import PipelineStats
    from .engine_stats import EngineStats, EpisodeStats, TrainerStats

METRICS, TRACE, LIVE = "metrics.jsonl", "trace.json", "live.json"
LIVE_MAX_BYTES = 64 * 1024  # a marker is ~150 bytes and a name per rollout model: more is not one


class LiveRun(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``RUN_DIR/live.json``: the run that serves scale requests in this folder now."""

    run_id: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]  # uuid4 hex, one per learn()
    pid: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]  # a pid_t: os.kill refuses larger ones
    host: str
    started: float  # time.time() when the run began
    models: list[str] = []  # the rollout models `flowrl scale` may resize (empty: not said)


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes. Never follows a
    symlink nor waits on a FIFO or device (O_NOFOLLOW | O_NONBLOCK, then fstat on what was opened:
    the path may be swapped between the checks). FileNotFoundError when absent, ConfigError when
    it is something else, OSError when it cannot be read."""
    refuse_irregular(path, os.lstat(path), limit)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    with os.fdopen(os.open(path, flags), "rb") as f:
        refuse_irregular(path, os.fstat(f.fileno()), limit)
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew after fstat
        raise ConfigError(f"{path}: expected a regular file of at most {limit} bytes, it has more")
    return data


def refuse_irregular(path: Path, st: os.stat_result, limit: int) -> None:
    """ConfigError unless ``st`` is a regular file of at most ``limit`` bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: expected a regular file, found {file_kind(st.st_mode)}")
    if st.st_size > limit:
        raise ConfigError(f"{path}: expected a regular file of at most {limit} bytes, it has {st.st_size}")


def file_kind(mode: int) -> str:
    kinds = [(stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO")]
    kinds += [(stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")]
    return next((name for test, name in kinds if test(mode)), "a regular file")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a temporary file of a name no concurrent writer shares
    (pid and a uuid), then os.replace, which also replaces a symlink rather than writing through it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def live_run(folder: Path, models: list[str]) -> Iterator[LiveRun]:
    """``folder/live.json`` while the block runs, removed when it ends however it ends (a killed
    process leaves it: readers check the pid)."""
    host, started = socket.gethostname(), time.time()
    run = LiveRun(run_id=uuid.uuid4().hex, pid=os.getpid(), host=host, started=started, models=models)
    write_atomic(folder / LIVE, msgspec.json.encode(run))
    try:
        yield run
    finally:
        _remove_marker(folder / LIVE, run)


def _remove_marker(path: Path, run: LiveRun) -> None:
    """Remove ``path`` if it is still ``run``'s marker (another run in this folder may have
    replaced it since; that one removes its own)."""
    with contextlib.suppress(OSError, ConfigError, msgspec.DecodeError, msgspec.ValidationError):
        if msgspec.json.decode(read_regular(path, LIVE_MAX_BYTES), type=LiveRun).run_id == run.run_id:
            path.unlink()


def find_live_run(folder: Path) -> LiveRun:
    """The run serving ``folder`` now; ConfigError ("no live run in ...") when none is: no marker,
    one that is not a marker, or one whose process is gone (checked only on this host)."""
    path = folder / LIVE
    try:
        run = msgspec.json.decode(read_regular(path, LIVE_MAX_BYTES), type=LiveRun)
    except FileNotFoundError:
        raise ConfigError(
            f"no live run in {folder}: no {LIVE} (an engine writes it while learn() runs with "
            "RunConfig.run_dir set to this folder)"
        ) from None
    except (OSError, ConfigError, msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ConfigError(f"no live run in {folder}: {path} is not a run marker ({err})") from err
    if run.host == socket.gethostname() and not _alive(run.pid):
        raise ConfigError(
            f"no live run in {folder}: {path} names process {run.pid} on {run.host}, which has ended (killed?)"
        )
    return run


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only checks that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


class RunDir:
    """The files an engine writes into ``RunConfig.run_dir``. A run folder may hold what nobody
    meant for it: a symlink or FIFO where a file goes is refused when the engine is built, and
    every write is opened so that it neither follows a link nor waits on a FIFO."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            for name in (METRICS, TRACE):
                with contextlib.suppress(FileNotFoundError):
                    refuse_irregular(self.path / name, os.lstat(self.path / name), 2**62)
        except (OSError, ConfigError) as err:
            raise ConfigError(f"RunConfig.run_dir={str(path)!r} cannot hold a run's files: {err}") from err
        self._next: int | None = None  # the episode after the last line this engine wrote

    def episode(self, stats: EngineStats) -> None:
        """Append the last episode of ``stats`` to ``metrics.jsonl``, after dropping the lines of
        that episode and later ones when this engine did not write them just before."""
        e = stats.episodes[-1].episode
        if self._next is None or e < self._next:
            # an earlier run's lines are its record: kept aside; this engine's own are redone
            self.drop_from(e, keep=self._next is None)
        self._next = e + 1
        line: dict[str, Any] = {
            **msgspec.to_builtins(stats.episodes[-1]),
            "time": time.time(),
            "trainers": msgspec.to_builtins(stats.trainers),
            "rollout": msgspec.to_builtins(stats.rollout.stages) if stats.rollout is not None else {},
            "rollout_blocked_s": stats.rollout.blocked_s if stats.rollout is not None else 0.0,
            "rollout_serving": stats.rollout.serving if stats.rollout is not None else {},
        }
        path = self.path / METRICS
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            with os.fdopen(os.open(path, flags, 0o644), "ab") as f:
                refuse_irregular(path, os.fstat(f.fileno()), 2**62)
                f.write(msgspec.json.encode(line) + b"\n")
        except (OSError, ConfigError) as err:  # a full disk, or a FIFO or link put there since
            raise FlowError(f"run folder {self.path}: cannot append to {METRICS} ({err})") from err

    def drop_from(self, episode: int, *, keep: bool = False) -> int:
        """Remove the lines of ``metrics.jsonl`` of ``episode`` and later ones (and a line a killed
        process left cut short): the kept lines go, a line at a time, to a new file renamed over
        the old one, so that a reader sees one file or the other. ``keep``: the old file stays,
        under the first free name ``metrics.jsonl.<n>``, and a line says where. How many lines went."""
        path = self.path / METRICS
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        tmp = path.with_name(f".{METRICS}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
        try:
            with os.fdopen(os.open(path, flags), "rb") as f:
                refuse_irregular(path, os.fstat(f.fileno()), 2**62)
                dropped = _copy_before(f, tmp, episode)
            backup = _link_aside(path) if dropped and keep else None
            if dropped:
                os.replace(tmp, path)
        except FileNotFoundError:
            return 0
        except (OSError, ConfigError) as err:
            raise FlowError(
                f"run folder {self.path}: cannot append to {METRICS} (dropping the lines of episodes >= {episode} "
                f"first: {err})"
            ) from err
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if backup is not None:
            say(
                f"run folder {self.path}: {METRICS} held {dropped} line(s) of episodes >= {episode} from an "
                f"earlier run; that file is kept as {backup.name}"
            )
        return dropped

    def trace(self, spans: list[Span]) -> Path:
        path = self.path / TRACE
        try:
            write_atomic(path, json.dumps(chrome_trace(spans)).encode())
        except OSError as err:
            raise FlowError(f"run folder {self.path}: cannot write {TRACE} ({err})") from err
        return path


def _link_aside(path: Path) -> Path:
    """A second name for ``path``, ``<name>.<n>`` with the first free ``n`` (a hard link: the
    file itself stays where readers find it until the new one replaces it)."""
    n = 1
    while True:
        backup = path.with_name(f"{path.name}.{n}")
        try:
            os.link(path, backup, follow_symlinks=False)
            return backup
        except FileExistsError:  # an earlier backup: never over it
            n += 1


def _copy_before(source: BinaryIO, tmp: Path, episode: int) -> int:
    """Copy the lines of ``source`` before ``episode`` to ``tmp`` (a new file); how many it left out."""
    dropped = 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as out:
        for line in source:
            if _before(line, episode):
                out.write(line if line.endswith(b"\n") else line + b"\n")
            else:
                dropped += 1
    return dropped


def _before(line: bytes, episode: int) -> bool:
    """Whether ``line`` of ``metrics.jsonl`` is of an episode before ``episode``; False for a line
    that is not one of its lines (cut short by a killed process)."""
    try:
        return msgspec.json.decode(line, type=_Line).episode < episode
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


class _Line(msgspec.Struct):
    episode: int


Metric = tuple[str, str, dict[str, str], float]  # name, description, tags, value


def metric_values(stats: EngineStats) -> list[Metric]:
    """The engine's counters after its last episode, as gauges."""
    if not stats.episodes:
        return []
    last = stats.episodes[-1]
    out = _episode_gauges(last) + _trainer_gauges(stats.trainers) + _stale_gauges(last)
    return out + (_rollout_gauges(stats.rollout) if stats.rollout is not None else [])


def _episode_gauges(last: EpisodeStats) -> list[Metric]:
    phase = "seconds of each phase in the last episode"
    out: list[Metric] = [("flowrl_episodes", "episodes done", {}, float(last.episode + 1))]
    out += [
        ("flowrl_phase_seconds", phase, {"phase": p}, float(getattr(last, f"{p}_s")))
        for p in ("rollout", "train", "sync", "eval")
    ]
    version = "weight version an inference model runs"
    out += [("flowrl_weight_version", version, {"model": m}, float(v)) for m, v in last.weight_versions.items()]
    lag = "most versions behind of a sample trained in the last episode"
    out += [("flowrl_staleness_max", lag, {"model": m}, float(max(lags))) for m, lags in last.staleness.items()]
    metric = "a metric train_step returned (loss, reward, ...), averaged over the last episode's steps"
    return out + [
        ("flowrl_train_metric", metric, {"trainer": t, "metric": k}, float(v))
        for t, values in last.metrics.items()
        for k, v in values.items()
    ]


def _trainer_gauges(trainers: dict[str, TrainerStats]) -> list[Metric]:
    out: list[Metric] = []
    for name, trainer in trainers.items():
        out.append(("flowrl_trainer_steps", "optimizer steps of a trainer", {"trainer": name}, float(trainer.steps)))
        out.append(
            ("flowrl_trainer_samples", "samples a trainer trained on", {"trainer": name}, float(trainer.samples))
        )
    return out


def _stale_gauges(last: EpisodeStats) -> list[Metric]:
    wait = "seconds training waited for the last episode's rollout"
    out: list[Metric] = [("flowrl_rollout_wait_seconds", wait, {}, float(last.wait_s))]
    out += [
        (
            f"flowrl_stale_{kind}",
            f"samples over the staleness bound {kind} in the last episode",
            {},
            float(getattr(last, kind)),
        )
        for kind in ("dropped", "regenerated")
    ]
    return out


def _rollout_gauges(rollout: PipelineStats) -> list[Metric]:
    serving = "replicas serving in a rollout pool"
    out: list[Metric] = [("flowrl_pool_replicas", serving, {"model": m}, float(n)) for m, n in rollout.serving.items()]
    blocked = "seconds admission waited for room in the in-flight window"
    out.append(("flowrl_rollout_blocked_seconds", blocked, {}, rollout.blocked_s))
    for stage, s in rollout.stages.items():
        tags = {"stage": stage, "model": s.model}
        out.append(("flowrl_stage_samples", "samples a rollout stage completed", tags, float(s.samples)))
        out.append(("flowrl_stage_busy_seconds", "seconds a stage's replicas were busy", tags, s.busy_s))
        out.append(("flowrl_stage_retried", "samples sent to a stage again", tags, float(s.retried)))
        out.append(("flowrl_stage_queued", "samples ready for a stage that no replica took yet", tags, float(s.queued)))
        out.append(("flowrl_stage_queue_peak", "the most samples that waited for a stage", tags, float(s.queue_peak)))
        for r in s.replicas:
            rtags = {**tags, "replica": str(r.replica)}
            out.append(("flowrl_replica_busy_seconds", "seconds a replica was busy on a stage", rtags, r.busy_s))
            out.append(("flowrl_replica_idle_seconds", "seconds a replica ran no stage", rtags, r.idle_s))
            starved = "seconds a replica had no shard and waited for one"
            out.append(("flowrl_replica_starved_seconds", starved, rtags, r.starved_s))
    return out
