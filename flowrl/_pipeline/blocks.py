"""Deterministic mode's blocks, pipeline side: each sample's place in its run.

``PoolScheduler`` (deterministic) cuts a stage's shards as fixed blocks of positions in a run;
the pipeline tells it where each ready sample sits, and when a run's admission is done (its
last, shorter block may go then). A stage inside a loop's body gets no places: which samples
are still in the loop at a turn depends on which stopped, so its blocks are of one sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._core.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._core.flow.graph import FlowGraph
    from .._core.settings.config import PipelineConfig
    from .inflight import Run
    from .ledger import Ledger
    from .pools import AsyncPool


class Places:
    """(run, position) of samples, read from the ledger."""

    def __init__(self, graph: FlowGraph, ledger: Ledger) -> None:
        self._ledger = ledger
        self._in_loop = {name for loop in graph.loops.values() for name in loop.body}
        self._chosen: tuple[Run | None, dict[int, int]] = (None, {})  # the last run with ids of its own

    def __call__(self, stage: str, ids: list[int]) -> list[tuple[int, int]] | None:
        if stage in self._in_loop:
            return None
        out = []
        for sid in ids:
            run = self._ledger.samples[sid].run
            out.append((run.index, self._position(run, sid)))
        return out

    def _position(self, run: Run, sid: int) -> int:
        if run.ids is None:  # numbered on from the run's first id
            return sid - run.first_id
        if self._chosen[0] is not run:  # ids the caller chose (``run(ids=...)``): the items' order
            self._chosen = (run, {i: k for k, i in enumerate(run.ids)})
        return self._chosen[1][sid]


def place_blocks(graph: FlowGraph, ledger: Ledger, pools: Mapping[str, AsyncPool]) -> None:
    """Hand every pool its samples' places (deterministic mode)."""
    places = Places(graph, ledger)
    for pool in pools.values():
        pool.places = places


def seal(pools: Mapping[str, AsyncPool], run: Run) -> None:
    """``run``'s admission is done: every pool may cut its last blocks."""
    for pool in pools.values():
        pool.seal(run.index, run.admitted)


def check_deterministic(graph: FlowGraph, config: PipelineConfig, key: str = "PipelineConfig.deterministic") -> None:
    """What deterministic mode cannot run, refused before any replica starts (``key``: the
    setting that asked for it)."""
    if not config.deterministic:
        return
    for name, model in graph.models.items():
        if model.config.on_spent == "drop":
            raise ConfigError(
                f"{key}=True with model {name!r}'s ModelConfig.on_spent='drop': a dropped sample never "
                "reaches the later stages, whose block of sample ids would wait for it; use on_spent='fail'"
            )
    # A block is cut once all its members are ready: the window must hold a whole block of every
    # stage at once, or admission waits for room that only the waiting blocks would free.
    need = sum(graph.models[spec.model].config.batch_size for spec in graph.stages.values())
    if config.max_inflight < need:
        raise ConfigError(
            f"{key}=True needs PipelineConfig.max_inflight >= {need} (the sum of the stages' batch_size: each "
            f"stage waits for whole blocks of batch_size samples, which must fit in the window), got "
            f"max_inflight={config.max_inflight}"
        )
