"""Resizing an engine's inference pools while it runs: the API, and the requests
``flowrl scale RUN_DIR model=N`` leaves in the run directory.

A request file (``scale.json``: model -> replicas) is picked up within a second while
``learn()`` runs; what was done is written back to ``scale.done.json`` (or the error, to
``scale.failed.json``), and logged.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from .._core.errors import ConfigError, FlowError

if TYPE_CHECKING:
    from .._pipeline.pipeline import AsyncPipeline

log = logging.getLogger("flowrl")
REQUEST, DONE, FAILED = "scale.json", "scale.done.json", "scale.failed.json"
POLL_S = 0.5


def request_scale(run_dir: str | Path, sizes: dict[str, int]) -> Path:
    """Leave a resize request for the engine writing ``run_dir`` (atomically)."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder; give the run_dir of a running engine (RunConfig.run_dir)")
    tmp = folder / f".{REQUEST}.tmp"
    tmp.write_bytes(msgspec.json.encode(sizes))
    os.replace(tmp, folder / REQUEST)
    return folder / REQUEST


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

    async def watch_requests(self, folder: Path) -> None:
        """Apply the resize requests ``flowrl scale`` leaves in ``folder``."""
        while True:
            await anyio.sleep(POLL_S)  # a control loop's period
            path = folder / REQUEST
            if path.exists():
                raw = path.read_bytes()
                path.unlink()
                await self._apply(folder, raw)

    async def _apply(self, folder: Path, raw: bytes) -> None:
        try:
            sizes = msgspec.json.decode(raw, type=dict[str, int])
            done = {name: await self.resize(name, n) for name, n in sizes.items()}
        except (FlowError, msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("resize request %r failed: %s", raw.decode(errors="replace"), err)
            (folder / FAILED).write_text(f"{type(err).__name__}: {err}\n")
            return
        (folder / DONE).write_bytes(msgspec.json.encode({"requested": sizes, "changed": done}))
