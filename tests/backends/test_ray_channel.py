"""The socket channel of replicas on the driver's node: the channel alone (no Ray), then
through real pipelines on the local Ray cluster, against the Ray-call path."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl.testing import Fail, Scale, flowrl_actor_names

CPU = {"cpus_per_replica": 0.25}


def _echo(seq: int, body: bytes) -> bytes:
    return f"{seq}:".encode() + body


@contextlib.asynccontextmanager
async def _pair(answer=_echo, prepare=None):
    """A channel server, one replica end served by a one-thread worker, and the driver's end."""
    from flowrl._backends.local_channel import ChannelServer, ReplicaWorker

    server = ChannelServer()
    await server.start()
    try:
        pending = server.expect("me")
        replica = ReplicaWorker()
        extra = () if prepare is None else (prepare,)
        await asyncio.to_thread(replica.connect, server.path, "me", answer, *extra)
        driver = await asyncio.wait_for(pending, 10)
        yield replica, driver
        driver.close()
    finally:
        server.close()


def _stuck(release: threading.Event):
    """An answer that waits for ``release``: its calls stay in flight."""

    def answer(seq: int, body: bytes) -> bytes:
        release.wait(10)
        return body

    return answer


async def test_replies_match_their_calls_in_order() -> None:
    async with _pair() as (_, driver):
        sent = [driver.send(f"call {i}".encode()) for i in range(50)]
        replies = await asyncio.gather(*(future for _, future in sent))
        assert [seq for seq, _ in sent] == list(range(50))
        assert replies == [f"{i}:call {i}".encode() for i in range(50)]
        assert driver.usable()


async def test_shards_are_prepared_on_the_channel_thread_and_answered_in_order_on_the_worker() -> None:
    threads: dict[str, set[str]] = {"prepare": set(), "answer": set()}

    def prepare(seq: int, body: bytes) -> bytes:
        threads["prepare"].add(threading.current_thread().name)
        return body.upper()

    def answer(seq: int, prepared: bytes) -> bytes:
        threads["answer"].add(threading.current_thread().name)
        return f"{seq}:".encode() + prepared

    async with _pair(answer, prepare) as (replica, driver):
        sent = [driver.send(f"call {i}".encode()) for i in range(20)]
        on_worker = await asyncio.wrap_future(replica.submit(lambda: threading.current_thread().name))
        replies = await asyncio.gather(*(future for _, future in sent))
    assert replies == [f"{i}:CALL {i}".encode() for i in range(20)]
    assert threads == {"prepare": {"flowrl-channel"}, "answer": {on_worker}} and on_worker == "flowrl-replica"


async def test_a_closed_replica_end_fails_every_waiting_call_and_retires_the_channel() -> None:
    from flowrl._backends.local_channel import ChannelLost

    release = threading.Event()
    async with _pair(_stuck(release)) as (replica, driver):
        futures = [driver.send(b"x")[1] for _ in range(3)]
        replica.close_channel()  # as if its process died while holding the shards
        for future in futures:
            with pytest.raises(ChannelLost):
                await asyncio.wait_for(future, 10)
        assert not driver.usable()
        release.set()


async def test_closing_the_driver_end_fails_calls_in_flight_with_pipeline_closed() -> None:
    release = threading.Event()
    async with _pair(_stuck(release)) as (_, driver):
        _, future = driver.send(b"x")
    with pytest.raises(flowrl.PipelineClosedError):
        await future
    release.set()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_worker_thread_that_dies_closes_its_channel_and_fails_later_jobs() -> None:
    from flowrl._backends.local_channel import ChannelLost

    def broken(seq: int, body: bytes) -> bytes:
        raise AssertionError("a bug in the replica's answer")

    async with _pair(broken) as (replica, driver):
        _, future = driver.send(b"x")
        with pytest.raises(ChannelLost):
            await asyncio.wait_for(future, 10)
        with pytest.raises(RuntimeError, match="worker thread stopped"):
            replica.submit(lambda: 1).result(timeout=10)  # a Ray call's job: an error, not a hang
        replica.thread.join(10)  # its error is reported within this test, where the warning is expected
        assert not replica.thread.is_alive()


async def test_a_connection_with_an_unknown_token_is_refused() -> None:
    from flowrl._backends.local_channel import ChannelServer

    server = ChannelServer()
    await server.start()
    try:
        reader, writer = await asyncio.open_unix_connection(server.path)
        writer.write((5).to_bytes(4, "little") + b"nobody")
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed on it
        writer.close()
    finally:
        server.close()


# ---- through pipelines on the Ray cluster -------------------------------------------------


class Wide(flowrl.Model):
    """Adds ``wide``: ``width`` copies of each sample's id (more than fits in a reply)."""

    def __init__(self, name: str, config: dict[str, Any], width: int) -> None:
        super().__init__(name, config)
        self.width = width

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"wide": np.repeat(batch.ids[:, None].astype(np.float64), self.width, axis=1)}


class ThreadState(flowrl.Model):
    """Reports a thread-local value set in ``setup`` (as torch's grad mode would be)."""

    def setup(self) -> None:
        self.local = threading.local()
        self.local.mode = f"set in setup of replica {self.replica_id}"

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"mode": [getattr(self.local, "mode", "unset")] * len(batch)}


class Reused(flowrl.Model):
    """Returns rows of one buffer that every step overwrites (as a model reusing its output
    buffer would): what it returned must be kept as it was."""

    def __init__(self, name: str, config: dict[str, Any], width: int) -> None:
        super().__init__(name, config)
        self.width = width

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        if not hasattr(self, "buffer"):
            self.buffer = np.zeros((8, self.width))
        self.buffer[: len(batch)] = batch.ids[:, None]
        return {"wide": self.buffer[: len(batch)]}


def _count_channel_calls(monkeypatch) -> list[int]:
    from flowrl._backends.ray_backend import RayBackend

    count = [0]
    real = RayBackend._call_over

    async def spy(self, *args):
        count[0] += 1
        return await real(self, *args)

    monkeypatch.setattr(RayBackend, "_call_over", spy)
    return count


@pytest.mark.parametrize("channels", [True, False])
async def test_setup_state_of_the_replica_thread_holds_in_every_step(ray_cluster, monkeypatch, channels):
    count = _count_channel_calls(monkeypatch)
    model = ThreadState("t", {"num_replicas": 2, "batch_size": 2, **CPU})
    async with flowrl.open_pipeline(lambda x: model.forward_step(x), {"local_channels": channels}) as pipe:
        out = await pipe.run([{"x": [i]} for i in range(12)])
    assert all(s["mode"].startswith("set in setup of replica") for s in out)
    assert count[0] == (6 if channels else 0)  # 12 samples in shards of 2 over the channel, or none
    assert flowrl_actor_names() == []


def test_a_pipeline_runs_its_shards_over_the_channel_inside_uvloop(ray_cluster, monkeypatch):
    """uvloop's transports do not subclass asyncio's: a driver end that checked for them refused
    every replica, and the pipeline waited for its channels until ``setup_timeout_s``."""
    uvloop = pytest.importorskip("uvloop")
    count = _count_channel_calls(monkeypatch)
    model = ThreadState("t", {"num_replicas": 2, "batch_size": 2, **CPU})

    async def run() -> list[flowrl.Sample]:
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        async with flowrl.open_pipeline(lambda x: model.forward_step(x), {"local_channels": True}) as pipe:
            return await pipe.run([{"x": [i]} for i in range(12)])

    out = uvloop.run(run())
    assert sorted(s["x"][0] for s in out) == list(range(12))
    assert count[0] == 6  # every shard went over the channel
    assert flowrl_actor_names() == []


async def test_outputs_too_big_for_the_socket_are_taken_into_shared_memory(ray_cluster, monkeypatch):
    from flowrl._backends.ray_wire import SMALL_BYTES

    count = _count_channel_calls(monkeypatch)
    width = SMALL_BYTES // 8 + 1  # one sample's field is already too big to ride back
    wide = Wide("wide", {"num_replicas": 2, "batch_size": 2, **CPU}, width)
    sink = Scale("sink", {"num_replicas": 2, "batch_size": 3, **CPU}, srcs=["wide"], dst="total", factor=1.0)
    async with flowrl.open_pipeline(lambda x: sink.forward_step(wide.forward_step(x))) as pipe:
        out = await pipe.run([{"x": [i]} for i in range(8)])
    assert [s.id for s in out] == list(range(8))
    assert all(s["wide"].shape == (width,) and np.all(s["wide"] == s.id) for s in out)
    assert all(np.allclose(s["total"], s["wide"]) for s in out)
    assert count[0] == 4  # the wide calls; the sink reads stored objects through Ray calls
    assert flowrl_actor_names() == []


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("backend", ["channel", "ray-calls", "inprocess"])
async def test_outputs_are_kept_as_returned_when_the_model_reuses_its_buffer(ray_cluster, backend, big):
    from flowrl._backends.ray_wire import SMALL_BYTES

    width = SMALL_BYTES // 8 + 1 if big else 4
    model = Reused("r", {"num_replicas": 1, "batch_size": 1, "prefetch": 2, **CPU}, width)
    config = {"backend": "inprocess"} if backend == "inprocess" else {"local_channels": backend == "channel"}
    async with flowrl.open_pipeline(lambda x: model.forward_step(x), config) as pipe:
        out = await pipe.run([{"x": [i]} for i in range(12)])
    assert [s.id for s in out] == list(range(12))
    assert all(np.all(s["wide"] == s.id) for s in out)


async def test_an_error_over_the_channel_names_the_shard_and_carries_the_replica_traceback(ray_cluster):
    from flowrl._backends.local_channel import RemoteTraceback

    bad = Fail("bad", {"num_replicas": 2, "batch_size": 2, **CPU}, bad_id=5)
    with pytest.raises(flowrl.StageError, match=r"stage 'bad\.forward_step'.*ValueError: bad sample 5") as info:
        async with flowrl.open_pipeline(lambda x: bad.forward_step(x)) as pipe:
            await pipe.run([{"x": [i]} for i in range(10)])
    assert 5 in info.value.sample_ids and info.value.replica in (0, 1)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and "forward_step" in str(cause) and "ValueError" in str(cause)
    assert flowrl_actor_names() == []


async def test_a_channel_that_cannot_open_fails_the_start_with_a_cluster_error(ray_cluster, monkeypatch):
    from flowrl._backends.local_channel import ChannelServer

    async def listen_nowhere(self) -> None:  # no socket at the path: the replicas cannot connect
        return None

    monkeypatch.setattr(ChannelServer, "start", listen_nowhere)
    model = Scale("m", {"num_replicas": 2, **CPU}, srcs=["x"], dst="y")
    with pytest.raises(flowrl.ClusterError, match="local channels.*local_channels=False"):
        async with flowrl.open_pipeline(lambda x: model.forward_step(x)):
            pass
    assert flowrl_actor_names() == []


def test_weights_submitted_first_run_right_after_the_running_job_before_queued_ones():
    from flowrl._backends.local_channel import ReplicaWorker

    worker, release, order = ReplicaWorker(), threading.Event(), []
    running = worker.submit(release.wait)  # the shard running now
    queued = [worker.submit(order.append, f"shard {i}") for i in range(2)]  # sent ahead
    weights = worker.submit(order.append, "weights", first=True)
    release.set()
    for future in (running, *queued, weights):
        future.result(timeout=10)
    assert order == ["weights", "shard 0", "shard 1"]


@pytest.mark.parametrize("merge", [1, 2])
def test_a_merging_worker_runs_shards_at_once_and_weights_only_when_none_runs(merge):
    """merge=2: the second shard runs while the first still does, and weights submitted first
    wait for both. merge=1: the second waits for the first, and the weights go between them."""
    from flowrl._backends.local_channel import ReplicaWorker

    worker, order = ReplicaWorker(merge), []
    first_started, second_started, hold = threading.Event(), threading.Event(), threading.Event()

    def first_shard():
        first_started.set()
        hold.wait(timeout=30)
        order.append(f"first ends, the second ran: {second_started.is_set()}")

    def second_shard():
        second_started.set()
        order.append("second runs")

    shards = [worker.submit(first_shard, shard=True), worker.submit(second_shard, shard=True)]
    assert (second_started if merge == 2 else first_started).wait(timeout=30)
    weights = worker.submit(order.append, "weights", first=True)
    hold.set()
    for future in (*shards, weights):
        future.result(timeout=30)
    if merge == 2:
        assert order == ["second runs", "first ends, the second ran: True", "weights"]
    else:
        assert order == ["first ends, the second ran: False", "weights", "second runs"]


async def test_replies_that_come_out_of_order_settle_their_own_calls():
    """A merging replica answers a short shard sent second before a long one sent first."""
    from flowrl._backends.local_channel import ChannelServer, ReplicaWorker

    server = ChannelServer()
    await server.start()
    expected = server.expect("t")
    worker, release = ReplicaWorker(merge=2), threading.Event()

    def answer(seq, body):
        if body == b"slow":
            release.wait(timeout=30)
        return b"OK" + body

    await asyncio.to_thread(worker.connect, server.path, "t", answer)
    end = await expected
    _, slow = end.send(b"slow")
    _, fast = end.send(b"fast")
    assert await asyncio.wait_for(fast, 30) == b"OKfast"
    assert not slow.done()
    release.set()
    assert await asyncio.wait_for(slow, 30) == b"OKslow"
    worker.close_channel()
    server.close()


class Merging(flowrl.Model):
    """Merges shards (as an engine's continuous batching): a step waits for a second step to
    run beside it (up to 30 s; the last may have none), then works 0.3 s. Each sample gets the
    most steps that ran at once and its step's interval."""

    merges_shards = True

    def setup(self) -> None:
        self.lock, self.inside, self.most = threading.Lock(), 0, 0
        self.met = threading.Event()

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        start = time.perf_counter()
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
            if self.inside >= 2:
                self.met.set()
        self.met.wait(timeout=30)
        time.sleep(0.3)  # the step's work, shared with the step beside it
        with self.lock:
            self.inside -= 1
            most = self.most
        return {"most": [most] * len(batch), "span": [[start, time.perf_counter()]] * len(batch)}


@pytest.mark.parametrize("channels", [True, False])
def test_a_replica_of_a_model_that_merges_shards_runs_two_at_once_and_counts_busy_time_once(ray_cluster, channels):
    model = Merging("m", {"num_replicas": 1, "batch_size": 4, "prefetch": 2, **CPU})
    with flowrl.Pipeline(lambda x: model.forward_step(x), {"local_channels": channels}) as pipe:
        out = pipe.run([{"x": [i]} for i in range(16)])
        stats = pipe.stats()["m.forward_step"]
    assert sorted(s.id for s in out) == list(range(16))
    assert max(s["most"] for s in out) == 2  # the second shard ran while the first did
    spans = {tuple(s["span"]) for s in out}  # one per call
    assert stats.calls == len(spans)
    assert stats.busy_s < sum(b - a for a, b in spans) - 0.2  # an overlap of 0.3 s or more, counted once
    assert flowrl_actor_names() == []
