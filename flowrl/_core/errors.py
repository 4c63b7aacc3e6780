"""The one exception tree of flowrl (imports nothing from flowrl)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence


class FlowError(Exception):
    """Base class of every error flowrl raises."""


class ConfigError(FlowError, ValueError):
    """A configuration value is missing, unknown or out of range."""


class FlowDefinitionError(FlowError):
    """A flow cannot be built: bad wiring, a field nobody writes, two writers of a field."""


class MissingFieldError(FlowDefinitionError, KeyError):
    """A batch or sample has no field of that name. Also a ``KeyError``, so mapping reads
    (``in``, ``.get``, ``dict(batch)``) behave as they do on a dict."""

    def __str__(self) -> str:  # the message as written, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class PipelineClosedError(FlowError):
    """The pipeline (or engine) was used after it closed or failed, or a stream was superseded."""


class CheckpointError(FlowError):
    """A checkpoint cannot be written or read, or does not fit the run that loads it."""


class ClusterError(FlowError):
    """The cluster cannot host the pools (not enough resources, replicas never started)."""


def _shorten(ids: Sequence[int], limit: int = 16) -> str:
    ids = list(ids)
    if len(ids) <= limit:
        return str(ids)
    return f"{ids[:limit]} … ({len(ids)} in all)"


class StageError(FlowError):
    """User code failed inside a stage; names the stage, the replica and the shard's samples.

    The original exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, stage: str, replica: int, sample_ids: Sequence[int]) -> None:
        self.message = message
        self.stage = stage
        self.replica = replica
        self.sample_ids = [int(i) for i in sample_ids]
        super().__init__(f"stage {stage!r}, replica {replica}, samples {_shorten(self.sample_ids)}: {message}")

    # keeps the fields when Ray pickles the error across processes
    def __reduce__(self) -> tuple[type[StageError], tuple[str, str, int, list[int]]]:
        return (type(self), (self.message, self.stage, self.replica, self.sample_ids))


class OutputError(StageError):
    """A stage returned something malformed: not a mapping, a wrong length, an overwrite."""


class ReplicaDiedError(StageError):
    """The replica's process died while it held a shard."""


class InputLostError(FlowError):
    """A stage output that a shard or the delivery needed was lost with the node that stored it
    (and could not be computed again)."""


class RankDivergenceError(FlowError):
    """The data-parallel ranks of a trainer hold different weights after their first train step
    (their gradients were not summed over the ranks, or they started from different weights)."""

    def __init__(self, message: str, trainer: str, ranks: Sequence[int], values: Sequence[object]) -> None:
        self.trainer = trainer
        self.ranks = [int(r) for r in ranks]
        self.values = list(values)
        super().__init__(message)

    def __reduce__(self) -> tuple[type[RankDivergenceError], tuple[str, str, list[int], list[object]]]:
        return (type(self), (str(self), self.trainer, self.ranks, self.values))
