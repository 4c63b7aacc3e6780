"""Resizing an engine's inference pools while it runs: the API, and the requests
``flowrl scale RUN_DIR model=N`` leaves in the run directory.

A request (``scale.json``, a ``ScaleRequest``) is bound to the run under way: ``request_scale``
reads the run's marker (``live.json``, see ``run_folder``) and refuses when no run is live, and
the request carries that run's id. While ``learn()`` runs, the watcher picks a request up within
a second and writes what was done to ``scale.done.json`` (or the error, to
``scale.failed.json``). It removes unread any request left before the run began, ignores one
for another run, and reads only a regular file of bounded size, in a worker thread: whatever
else is planted at the request path (a FIFO, a folder, a symlink to /dev/zero) is removed and
never blocks the event loop nor ends the run.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import anyio
import msgspec

from .._core.errors import ConfigError, FlowError
from .._core.names import check_name
from .run_folder import LiveRun, find_live_run, live_run, read_regular, refuse_irregular, write_atomic

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from anyio.abc import TaskStatus

    from .._pipeline.pipeline import AsyncPipeline

log = logging.getLogger("flowrl")
REQUEST, DONE, FAILED = "scale.json", "scale.done.json", "scale.failed.json"
POLL_S = 0.5
# A replica is at least one Ray actor, i.e. a process with its puller on the driver: 10,000 is
# beyond what one driver serves on any cluster, yet low enough that a typo (policy=40000) or a
# 5,000-digit number stops here rather than in the scheduler or in int()'s digit limit.
MAX_REPLICAS = 10_000
REQUEST_MAX_BYTES = 64 * 1024  # a request naming hundreds of models is a few KiB
_COUNT = re.compile(r"0*[0-9]{1,5}")  # ASCII digits only: str.isdigit() also takes '٣' and '²'

ModelName = Annotated[str, msgspec.Meta(min_length=1)]
Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS)]


class ScaleRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``RUN_DIR/scale.json``: replicas per model, for the run ``run`` (its ``LiveRun.run_id``)."""

    run: str
    sizes: dict[ModelName, Count]


def parse_sizes(items: Sequence[str]) -> dict[str, int]:
    """``MODEL=N`` arguments as model -> replicas; ConfigError naming the first bad item."""
    sizes: dict[str, int] = {}
    for item in items:
        name, eq, count = item.partition("=")
        if not name or not eq or not _COUNT.fullmatch(count) or not 1 <= int(count) <= MAX_REPLICAS:
            raise ConfigError(
                f"{item!r}: expected MODEL=N with N a whole number from 1 to {MAX_REPLICAS:,} in ASCII "
                "digits, e.g. policy=4"
            )
        if name in sizes:
            raise ConfigError(f"{item!r}: model {name!r} is given twice (once each)")
        check_name(name, f"{item!r}")
        sizes[name] = int(count)
    return sizes


def request_scale(run_dir: str | Path, sizes: Mapping[str, int]) -> Path:
    """Leave a resize request for the run live in ``run_dir`` (atomically); ConfigError when no
    run is live there, or a size is not a count from 1 to ``MAX_REPLICAS``."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder; give the run_dir of a running engine (RunConfig.run_dir)")
    try:
        checked = msgspec.convert(dict(sizes), type=dict[ModelName, Count], strict=True)
    except msgspec.ValidationError as err:
        raise ConfigError(
            f"request_scale({folder}, {dict(sizes)!r}): expected model -> replicas from 1 to {MAX_REPLICAS:,} ({err})"
        ) from err
    run = find_live_run(folder)
    unknown = sorted(n for n in checked if run.models and n not in run.models)
    if unknown:
        raise ConfigError(
            f"the run live in {folder} has no rollout model {', '.join(map(repr, unknown))} to resize; its rollout "
            f"models are {run.models}"
        )
    try:
        write_atomic(folder / REQUEST, msgspec.json.encode(ScaleRequest(run=run.run_id, sizes=checked)))
    except OSError as err:  # a folder planted at the request path, a full disk, no permission
        raise ConfigError(f"cannot leave a request at {folder / REQUEST}: {err}") from err
    return folder / REQUEST


def clear_requests(folder: Path) -> None:
    """(in a worker thread, before a run marks the folder live) Remove unread the request left in
    ``folder``: it was written for no run, or for an earlier one."""
    path = folder / REQUEST
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if _remove(path, st):
        log.warning("removed %s unread: it was left before this run began (for no run, or an earlier one)", path)
    else:
        log.warning("%s was left before this run began and cannot be removed; requests are ignored until it is", path)


class Inbox:
    """The request path of one run's folder, read without ever blocking on what is planted there."""

    def __init__(self, folder: Path, run_id: str) -> None:
        self.path = folder / REQUEST
        self.claimed = folder / f".{REQUEST}.{run_id}.taken"
        self._left: set[tuple[int, int]] = set()  # (device, inode) of what could not be removed: warned once

    def take(self) -> bytes | None:
        """(in a worker thread) The request waiting, claimed (renamed to this run's name first, so
        one written meanwhile is not lost) and removed; None when there is none or what is there
        is not a request file (removed if it can be)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return None
        try:
            refuse_irregular(self.path, st, REQUEST_MAX_BYTES)
            os.replace(self.path, self.claimed)
        except (ConfigError, OSError) as err:
            self._drop(st, err)
            return None
        try:
            return read_regular(self.claimed, REQUEST_MAX_BYTES)
        except (ConfigError, OSError) as err:  # swapped between lstat and the rename
            log.warning("ignored a scale request: %s", err)
            return None
        finally:
            left = _lstat(self.claimed)
            if left is not None:
                _remove(self.claimed, left)

    def _drop(self, st: os.stat_result, why: Exception) -> None:
        if _remove(self.path, st):
            log.warning("removed %s, not a scale request: %s", self.path, why)
        elif (st.st_dev, st.st_ino) not in self._left:
            self._left.add((st.st_dev, st.st_ino))
            log.warning("ignoring %s, not a scale request (%s); it cannot be removed: remove it", self.path, why)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _remove(path: Path, st: os.stat_result) -> bool:
    """Remove ``path`` (a folder only when empty: what is in it is not ours); whether it is gone."""
    try:
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


class Elasticity:
    """Resizes the rollout pools of a running engine: on request, and from the requests
    ``flowrl scale`` leaves in the run directory."""

    def __init__(self, trainers: list[str], rollout: AsyncPipeline) -> None:
        self.trainers = trainers
        self.rollout = rollout

    async def resize(self, model: str, replicas: int) -> list[int]:
        if model in self.trainers:
            raise ConfigError(
                f"{model!r} is a trainer: a data-parallel group keeps its world size; resize "
                "inference models of the rollout flow"
            )
        return await self.rollout.resize(model, replicas)

    async def watch_requests(
        self, folder: Path, *, task_status: TaskStatus[LiveRun] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Mark ``folder`` live and apply the resize requests ``flowrl scale`` leaves there for
        this run, until cancelled; under ``tg.start`` it returns once the marker is written."""
        await anyio.to_thread.run_sync(clear_requests, folder)  # before the marker: no request can be ours yet
        with live_run(folder, sorted(self.rollout.placement)) as run:
            inbox = Inbox(folder, run.run_id)
            task_status.started(run)
            while True:
                await anyio.sleep(POLL_S)  # a control loop's period
                raw = await anyio.to_thread.run_sync(inbox.take)
                if raw is not None:
                    await self._apply(folder, run.run_id, raw)

    async def _apply(self, folder: Path, run_id: str, raw: bytes) -> None:
        try:
            request = msgspec.json.decode(raw, type=ScaleRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            expected = f'{{"run": RUN_ID, "sizes": {{MODEL: N}}}} with N from 1 to {MAX_REPLICAS:,}'
            _write_back(folder / FAILED, raw, ConfigError(f"{folder / REQUEST}: expected {expected}; {err}"))
            return
        if request.run != run_id:
            log.warning("ignored a scale request for run %s: this run is %s (%s)", request.run, run_id, folder)
            return
        try:
            done = {name: await self.resize(name, n) for name, n in request.sizes.items()}
        except FlowError as err:
            _write_back(folder / FAILED, raw, err)
            return
        _write_back(folder / DONE, raw, {"run": run_id, "requested": request.sizes, "changed": done})


def _write_back(path: Path, raw: bytes, outcome: Exception | dict[str, object]) -> None:
    """What became of a request, for whoever asked; a folder that cannot take it ends nothing."""
    if isinstance(outcome, Exception):
        log.warning("resize request %r failed: %s", raw.decode(errors="replace"), outcome)
        data = f"{type(outcome).__name__}: {outcome}\n".encode()
    else:
        data = msgspec.json.encode(outcome)
    try:
        write_atomic(path, data)
    except OSError as err:
        log.warning("could not write %s: %s", path, err)
