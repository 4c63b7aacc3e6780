"""A Ctrl-C during a blocking ``learn()`` is never lost, whatever the load.

``anyio.run`` on asyncio turns SIGINT into a native cancellation of the main task and raises
KeyboardInterrupt only if that task then ends cancelled. A cancel scope of the flow that is being
cancelled at the same moment (a deadline, a failing task group) may take that cancellation for its
own, and the run then goes on to its last episode and exits 0. Here SIGINT is received as an
event instead: the first one cancels the run through a scope of our own and, however the run
ends after it, KeyboardInterrupt is raised; the handler is then removed, so a second Ctrl-C
interrupts at once.
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, TypeVar

import anyio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

T = TypeVar("T")


async def until_interrupted(run: Callable[[], Awaitable[T]]) -> T:
    """``await run()``; KeyboardInterrupt if SIGINT came meanwhile (in the main thread only: a
    signal handler can be set nowhere else, and Ctrl-C reaches only the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return await run()
    seen = anyio.Event()
    result: list[T] = []
    try:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                with anyio.open_signal_receiver(signal.SIGINT) as signals:
                    async for _ in signals:
                        seen.set()
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            result.append(await run())
            tg.cancel_scope.cancel()
    except BaseException as err:
        if seen.is_set():
            raise KeyboardInterrupt from err
        raise
    if seen.is_set():
        raise KeyboardInterrupt
    return result[0]
