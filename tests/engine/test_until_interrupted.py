"""``until_interrupted``: a blocking learn()'s guard for Ctrl-C. A SIGINT during the run always
ends in KeyboardInterrupt, even when the run shields itself and finishes; the run's own result
and errors come out as they are."""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import pytest

from flowrl._engine.interrupts import until_interrupted

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture(autouse=True)
def ctrl_c_handled() -> Iterator[None]:
    """Python's Ctrl-C handler, as a terminal's foreground process has it (a test runner started
    in the background hands its children SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_runs_result_and_its_own_error_come_out_as_they_are() -> None:
    async def answer() -> int:
        return 42

    async def fails() -> int:
        raise ValueError("the run's own")

    assert anyio.run(until_interrupted, answer) == 42
    with pytest.raises(ValueError, match="the run's own"):  # not wrapped in an exception group
        anyio.run(until_interrupted, fails)


def test_a_sigint_cancels_the_run_and_raises_keyboard_interrupt() -> None:
    reached: list[str] = []

    async def run() -> int:
        os.kill(os.getpid(), signal.SIGINT)
        try:
            await anyio.sleep_forever()
        finally:
            reached.append("cancelled")
        return 1

    with pytest.raises(KeyboardInterrupt):
        anyio.run(until_interrupted, run)
    assert reached == ["cancelled"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own, back


def test_a_sigint_is_not_lost_when_the_run_finishes_anyway() -> None:
    async def shielded() -> int:  # e.g. a checkpoint written whole whatever happens
        with anyio.CancelScope(shield=True):
            os.kill(os.getpid(), signal.SIGINT)  # noted at once, in this thread
            await anyio.lowlevel.checkpoint()  # the cancellation reaches the loop; the shield keeps it going
        return 7

    with pytest.raises(KeyboardInterrupt):
        anyio.run(until_interrupted, shielded)


def test_where_sigint_is_ignored_or_handled_by_the_user_it_is_left_alone() -> None:
    async def answer() -> int:
        assert signal.getsignal(signal.SIGINT) is mine  # not replaced during the run
        return 42

    def mine(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGINT, mine)
    assert anyio.run(until_interrupted, answer) == 42
    assert signal.getsignal(signal.SIGINT) is mine
