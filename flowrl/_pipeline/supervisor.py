"""The supervisor: the pipeline's task group, its first failure, and whether it is closed.

Every component that starts a task or meets a failure goes through it, so that the first
failure is the one reported, and whoever waits outside the task group (a run's consumer) is
woken by it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVarTuple

from .._core.errors import FlowError, PipelineClosedError

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from anyio.abc import TaskGroup

Args = TypeVarTuple("Args")


class Supervisor:
    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.closed = False
        self._tg: TaskGroup | None = None
        self._on_failure: list[Callable[[], None]] = []

    def attach(self, tg: TaskGroup) -> None:
        self._tg = tg

    def start_soon(self, fn: Callable[[*Args], Coroutine[Any, Any, Any]], *args: *Args) -> None:
        if self._tg is None:
            raise FlowError("internal: the pipeline's task group is not running")
        self._tg.start_soon(fn, *args)

    def on_failure(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` at a failure: it wakes a waiter outside the task group."""
        self._on_failure.append(wake)

    def fail(self, err: BaseException) -> None:
        """Record the first failure and wake consumers that wait outside the task group."""
        if self.error is None:
            self.error = err
        for wake in self._on_failure:
            wake()

    def raise_if_failed(self) -> None:
        if self.closed:
            raise PipelineClosedError("the pipeline is closed; open a new one")
        if self.error is not None:
            raise PipelineClosedError(f"the pipeline failed earlier: {self.error!r}") from self.error
