"""How shard data and replies travel in the Ray backend (real Ray, real object refs)."""

from __future__ import annotations

import asyncio
import pickle
import sys

import pytest


class _LocalRow:
    """A value class defined in a test module: replicas import it only because its module
    travels by value, so the fast pickler must leave it to cloudpickle."""

    def __init__(self, n: int) -> None:
        self.n = n


def test_dumps_falls_back_to_cloudpickle_for_by_value_and_local_objects() -> None:
    import ray.cloudpickle

    from flowrl._ray_wire import dumps

    assert dumps([1, "a"]) == pickle.dumps([1, "a"], protocol=5)  # the C pickler where safe
    local = lambda x: x + 1  # noqa: E731  (the C pickler refuses it)
    assert pickle.loads(dumps(local))(1) == 2
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        data = dumps(_LocalRow(3))
        assert __name__.encode() in pickle.dumps(_LocalRow(3)) and data != pickle.dumps(_LocalRow(3))
        assert pickle.loads(data).n == 3
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def _gate_and_echo(ray):
    @ray.remote
    class Gate:
        def __init__(self) -> None:
            self.opened = asyncio.Event()

        async def wait(self) -> str:
            await self.opened.wait()
            return "slow"

        async def open(self) -> None:
            self.opened.set()

    @ray.remote
    def echo(x):
        return x

    @ray.remote
    def boom():
        raise ValueError("boom")

    return Gate.remote(), echo, boom


async def test_replies_arrive_while_older_calls_run_errors_pass_through_and_close_is_not_final(ray_cluster) -> None:
    from ray.exceptions import RayTaskError

    from flowrl import PipelineClosedError
    from flowrl._ray_wire import Replies

    ray = ray_cluster
    gate, echo, boom = _gate_and_echo(ray)
    closed_gate = _gate_and_echo(ray)[0]  # never opened
    replies = Replies()
    try:
        slow = replies.wait(gate.wait.remote())
        # sent while the collecting thread waits on the slow call: it must still be seen
        assert await asyncio.wait_for(replies.wait(echo.remote(7)), 30) == 7
        assert not slow.done()
        with pytest.raises(RayTaskError, match="boom"):
            await asyncio.wait_for(replies.wait(boom.remote()), 30)
        abandoned = gate.wait.remote()
        replies.wait(abandoned).cancel()  # its caller left: the reply is dropped when it comes
        await gate.open.remote()
        assert await asyncio.wait_for(slow, 30) == "slow"
        await abandoned
        # a reply collected later comes with every reply that was ready before it
        await asyncio.wait_for(replies.wait(echo.remote(0)), 30)
        assert not replies._waiting
        stranded = replies.wait(closed_gate.wait.remote())  # never answered before close
        replies.close()
        with pytest.raises(PipelineClosedError):
            await asyncio.wait_for(stranded, 30)
        assert await asyncio.wait_for(replies.wait(echo.remote(5)), 30) == 5  # usable again
    finally:
        replies.close()
        ray.kill(gate)
        ray.kill(closed_gate)
    assert replies._thread is None
