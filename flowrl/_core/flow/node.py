"""What a flow function is called with while it is traced: ``Node`` placeholders.

A step called on a ``Node`` records a stage with the node's recorder (the flow graph being
built) instead of running. This module knows neither models nor graphs, so that both can
import it: the model base checks for a ``Node``, the graph builder records the stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import FlowDefinitionError


@dataclass(frozen=True)
class StepInfo:
    reads: frozenset[str] | None = None
    writes: frozenset[str] | None = None


class Recorder(Protocol):
    def add_stage(
        # ``model``: a ``flowrl.Model`` (typed loosely: this module may not import model.py)
        self,
        model: Any,
        method: str,
        args: tuple[object, ...],
        kwargs: dict[str, object],
        info: StepInfo,
    ) -> Node: ...


class Node:
    """A placeholder for the samples that leave a stage (or the flow's input) while tracing."""

    __slots__ = ("_builder", "_name")

    def __init__(self, builder: Recorder, name: str) -> None:
        self._builder = builder
        self._name = name

    def __repr__(self) -> str:
        return f"<flow output of {self._name}>"

    def _misuse(self, *_: Any, **__: Any) -> Any:
        raise FlowDefinitionError(
            f"the flow function runs once, at build time, on placeholders: {self!r} cannot be "
            "used as data here. Do computations inside a model step (mark custom step methods "
            "with @flowrl.step) and pass stage outputs only to other steps."
        )

    __getitem__ = __iter__ = __len__ = __bool__ = _misuse

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # protocol probes (copy, pickle, inspect) get the usual answer
            raise AttributeError(name)
        return self._misuse()
