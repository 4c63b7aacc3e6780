"""Resizing an engine's inference pools while it runs (layer 6): the API, and the requests
``flowrl scale RUN_DIR model=N`` leaves in the run directory.

A request file (``scale.json``: model -> replicas) is picked up within a second while
``learn()`` runs; what was done is written back to ``scale.done.json`` (or the error, to
``scale.failed.json``), and logged.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from .._core.errors import ConfigError, FlowError, PipelineClosedError

if TYPE_CHECKING:
    from .._core.model import Model
    from .parts import Live

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


class Elastic:
    """The resize half of ``Engine``."""

    trainers: list[Model]
    _live: Live | None
    _portal: Any

    def resize(self, model: str, replicas: int) -> list[int]:
        """Grow or shrink inference model ``model``'s rollout pool to ``replicas`` while the
        engine runs (call it from another thread during ``learn()``, or between calls); the
        replica ids added or removed. A replica removed finishes the shards it holds first;
        one added gets the weights the others hold before its first shard."""
        if self._portal is None:
            raise PipelineClosedError("resize() needs an engine open with `with engine:` (async: await aresize())")
        return self._portal.call(self.aresize, model, replicas)

    async def aresize(self, model: str, replicas: int) -> list[int]:
        live = self._live
        if live is None or live.rollout is None:
            raise PipelineClosedError("the engine is not running: resize it inside `with engine:`")
        if any(m.name == model for m in self.trainers):
            raise ConfigError(
                f"{model!r} is a trainer: a data-parallel group keeps its world size; resize "
                "inference models of the rollout flow"
            )
        return await live.rollout.resize(model, replicas)

    async def _watch_requests(self, folder: Path) -> None:
        """Apply the resize requests ``flowrl scale`` leaves in ``folder``."""
        while True:
            await anyio.sleep(POLL_S)  # a control loop's period
            path = folder / REQUEST
            if not path.exists():
                continue
            raw = path.read_bytes()
            path.unlink()
            try:
                sizes = msgspec.json.decode(raw, type=dict[str, int])
                done = {name: await self.aresize(name, n) for name, n in sizes.items()}
            except (FlowError, msgspec.DecodeError, msgspec.ValidationError) as err:
                log.warning("resize request %r failed: %s", raw.decode(errors="replace"), err)
                (folder / FAILED).write_text(f"{type(err).__name__}: {err}\n")
                continue
            (folder / DONE).write_bytes(msgspec.json.encode({"requested": sizes, "changed": done}))
