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

    from flowrl._backends.ray_wire import dumps

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
    from flowrl._backends.ray_wire import Replies

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


@pytest.mark.parametrize("stored", [False, True])
def test_a_shard_of_inline_rows_and_stored_objects_reaches_the_step_joined_in_its_id_order(stored: bool) -> None:
    """Inline rows of several producers (one producer split over two objects, rows out of
    order, one held as the pickle a replica replied with), and a stored object, travel framed
    by the driver and are joined in the replica in the shard's id order."""
    import msgspec
    import numpy as np

    from flowrl import Batch, Model
    from flowrl._backends.ray_wire import Inline, call_args, dumps, frame, run_call, unframe
    from flowrl._backends.replica import ReplicaRuntime
    from flowrl._core.settings.config import Piece, ShardCall, encode_message

    ids = [7, 3, 5]
    first = Inline(Batch([3, 9, 7], {"q": ["q3", "q9", "q7"]}))
    second = Inline(blob=dumps(Batch([5], {"q": ["q5"]})), rows=1)  # as a reply came: taken whole, forwarded
    policy = Batch([5, 7, 3], {"r": np.array([50.0, 70.0, 30.0])})
    pieces = [
        Piece(producer="input", ref=first, rows=[2, 0]),
        Piece(producer="input", ref=second, rows=[0]),
        Piece(producer="policy", ref="ref-0" if stored else Inline(policy), rows=[1, 2, 0]),
    ]
    call = ShardCall(stage="score.forward_step", method="forward_step", iteration=0, ids=ids, pieces=pieces)

    refs, body, sent = call_args(call)
    assert refs == (["ref-0"] if stored else [])
    parts = pickle.loads(body)
    assert parts[1] == second.blob and second._batch is None  # never unpickled here
    assert [p.ref for p in sent] == ([-1, -2, 0] if stored else [-1, -2, -3])

    class Score(Model):
        def forward_step(self, batch: Batch, iteration: int) -> dict:
            return {"s": [f"{q}:{r:g}" for q, r in zip(batch["q"], batch["r"], strict=True)]}

    blob = frame(encode_message(msgspec.structs.replace(call, pieces=sent)), body)
    reply, big = run_call(ReplicaRuntime(Score("score", {}), 0), blob, (policy,) if stored else ())
    out = pickle.loads(unframe(reply)[1])
    assert big is None and out.ids.tolist() == ids and out["s"] == ["q7:70", "q3:30", "q5:50"]
    assert Inline(blob=bytes(unframe(reply)[1]), rows=3).batch["s"] == out["s"]  # unpickled when read


def test_a_replica_calls_the_users_function_past_the_tracing_wrapper_but_keeps_its_decorators() -> None:
    import functools

    from flowrl import Batch, Model
    from flowrl._core.flow.model import step_target

    seen = []

    def logged(fn):
        @functools.wraps(fn)
        def wrapper(self, batch, iteration):
            seen.append(iteration)
            return fn(self, batch, iteration)

        return wrapper

    class M(Model):
        @logged
        def forward_step(self, batch: Batch, iteration: int) -> dict:
            return {"y": [1] * len(batch)}

    model = M("m", {})
    target = step_target(model, "forward_step")
    assert target.__func__ is not M.forward_step  # the tracing wrapper is skipped
    assert target(Batch([1]), 4) == {"y": [1]} and seen == [4]  # the user's decorator is not


def test_a_small_inline_batch_is_pickled_once_and_sent_whole_a_large_one_in_slices() -> None:
    """The driver limits one-sample shards: a small input chunk is pickled once and sent whole
    (once per call, whatever the pieces reading it), the replica selecting its rows; a large
    one still travels as the rows a call reads."""
    import numpy as np

    from flowrl import Batch
    from flowrl._backends.ray_wire import WHOLE_BYTES, Inline, call_args
    from flowrl._core.settings.config import Piece, ShardCall

    def sent(ref: Inline, rows: list[int], pieces: int = 1) -> tuple[list[bytes], list[Piece]]:
        call = ShardCall(
            stage="a.forward_step",
            method="forward_step",
            iteration=0,
            ids=[int(ref.batch.ids[r]) for r in rows],
            pieces=[Piece(producer=f"p{i}", ref=ref, rows=rows) for i in range(pieces)],
        )
        _, body, out = call_args(call)
        return pickle.loads(body), out

    small = Inline(Batch(list(range(64)), {"k": np.arange(64)}))
    parts, pieces = sent(small, [5], pieces=2)
    blob = small.blob
    assert blob is not None and len(parts) == 1 and parts[0] == blob
    assert [(p.ref, p.rows) for p in pieces] == [(-1, [5]), (-1, [5])]
    parts, pieces = sent(small, [9, 2])
    assert small.blob is blob and parts == [blob] and pieces[0].rows == [9, 2]  # not pickled again

    large = Inline(Batch(list(range(64)), {"x": np.zeros((64, 256))}))  # 128 KiB
    parts, pieces = sent(large, [5, 1])
    assert len(parts[0]) < WHOLE_BYTES and pickle.loads(parts[0]).ids.tolist() == [5, 1]
    assert pieces[0].rows == [0, 1]


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("owner", "an input of the shard is gone: the process that owned it exited (OwnerDiedError)"),
        ("node", "an input of the shard is gone: it was lost with the node that stored it (ObjectLostError)"),
    ],
)
def test_a_lost_input_says_whether_its_owner_exited_or_its_node_went(kind: str, says: str) -> None:
    from ray.exceptions import ObjectLostError, OwnerDiedError

    import flowrl
    from flowrl._backends.ray_wire import translate

    err = (OwnerDiedError if kind == "owner" else ObjectLostError)("ab" * 20, None, "")
    flow_err = translate(err, "policy.set_weights", 3, [])
    assert isinstance(flow_err, flowrl.InputLostError)
    assert str(flow_err) == f"stage 'policy.set_weights', replica 3, samples []: {says}"
