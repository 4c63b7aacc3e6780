"""The choice between the backends: the only module that names them both."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .inprocess import InProcessBackend
from .specs import debugging

if TYPE_CHECKING:
    from .._core.settings.config import PipelineConfig
    from .abc import Backend


def make_backend(config: PipelineConfig) -> Backend:
    if config.backend == "inprocess" or debugging():
        threads = config.inprocess_threads and not debugging()
        return InProcessBackend(threads=threads, deterministic=config.deterministic)
    # Ray is imported only when a pipeline runs on it: an in-process run (and ``import
    # flowrl``) does not pay for importing it (about 1 s).
    from .ray_backend import RayBackend

    return RayBackend(config)
