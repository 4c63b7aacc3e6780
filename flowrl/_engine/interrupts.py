"""A Ctrl-C during a blocking ``learn()`` is never lost, whatever the load.

``anyio.run`` on asyncio turns SIGINT into a native cancellation of the main task and raises
KeyboardInterrupt only if that task then ends cancelled. A run that shields a step (a checkpoint
written whole) or whose own cancel scope is being cancelled at that moment can absorb it, and
the run then goes on and exits 0. Here a handler of our own notes the SIGINT at once, in the
main thread, and cancels the run through a scope of our own; however the run ends after it,
KeyboardInterrupt is raised. A second Ctrl-C interrupts at once.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import FrameType

T = TypeVar("T")


async def until_interrupted(run: Callable[[], Awaitable[T]]) -> T:
    """``await run()``; KeyboardInterrupt if SIGINT came meanwhile. Only where Python's own
    Ctrl-C handler is in place, as asyncio does: in the main thread (a signal handler can be set
    nowhere else), and not where SIGINT is ignored (a job started in the background) or handled
    by the user's code."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        return await run()
    loop = asyncio.get_running_loop()
    seen: list[int] = []
    scope = anyio.CancelScope()

    def on_sigint(signum: int, frame: FrameType | None) -> Any:
        if seen:
            raise KeyboardInterrupt  # a second Ctrl-C: at once
        seen.append(signum)  # noted before any more of the run's code runs
        loop.call_soon_threadsafe(scope.cancel)  # cancelled from inside the loop

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with scope:
            result = await run()
    except BaseException as err:
        if seen:
            raise KeyboardInterrupt from err
        raise
    finally:
        signal.signal(signal.SIGINT, previous)
    if seen:
        raise KeyboardInterrupt
    return result
