"""The Ray path on a real local cluster: joins, ordering, errors, cleanup, placement."""

from __future__ import annotations

import traceback

import anyio
import numpy as np
import pytest

import flowrl
from flowrl.testing import Emit, Fail, Scale, flowrl_actor_names

CPU = {"cpus_per_replica": 0.25}


def items(n: int, start: int = 0) -> list[dict]:
    return [{"x": np.full(2, float(i))} for i in range(start, start + n)]


def diamond(jitter: int):
    """x -> a (3 replicas, batch 3) and b (2 replicas, batch 5) -> c(a, b): shuffled finishing order."""
    a = Scale(
        "a",
        {"num_replicas": 3, "batch_size": 3, **CPU},
        srcs=["x"],
        dst="a",
        factor=10,
        sleep_s=0.003,
        jitter_seed=jitter,
    )
    b = Scale(
        "b",
        {"num_replicas": 2, "batch_size": 5, "splitter": "greedy", **CPU},
        srcs=["x"],
        dst="b",
        factor=100,
        sleep_s=0.002,
        jitter_seed=jitter + 1,
    )
    c = Scale("c", {"num_replicas": 2, "batch_size": 4, **CPU}, srcs=["a", "b"], dst="c", jitter_seed=jitter + 2)

    def flow(x):
        return c.forward_step(a.forward_step(x), b.forward_step(x))

    return flow


@pytest.mark.parametrize("backend, jitter", [("ray", 1), ("ray-calls", 4), ("inprocess", 2), ("inprocess", 3)])
async def test_join_by_sample_id_whatever_the_finishing_order(ray_cluster, backend, jitter):
    n = 41
    config = {"backend": backend.removesuffix("-calls"), "inprocess_threads": True, "local_channels": backend == "ray"}
    async with flowrl.open_pipeline(diamond(jitter), config) as pipe:
        out = await pipe.run(items(n))
        stats = pipe.stats()
    assert [s.id for s in out] == list(range(n))
    for s in out:
        # each field derived from the sample's own x: joined by id, not by position in a shard
        assert np.allclose(s["a"], 10 * s.id) and np.allclose(s["b"], 100 * s.id)
        assert np.allclose(s["c"], 110 * s.id)
    # a shard of the cost splitter holds at most ModelConfig.shard_micro_batches (8) micro-batches
    # (it merges them when a call's fixed cost dominates, which timing decides); greedy's, one
    for stage, most in (("a.forward_step", 8 * 3), ("b.forward_step", 5), ("c.forward_step", 8 * 4)):
        assert stats[stage].samples == n
        assert 0 < stats[stage].max_shard <= most
    if backend != "inprocess":
        assert flowrl_actor_names() == []


class LastOne(flowrl.Model):
    """Sample ``k == 0`` finishes only after ``others`` marks have come through ``wait_on`` (a
    ``ray.util.queue.Queue``, which every replica and the test reach); with ``done``, replicas put
    a mark there per other sample they processed."""

    def __init__(self, name, config, others, wait_on, done=None):
        super().__init__(name, config)
        self.others, self.wait_on, self.done = others, wait_on, done

    def forward_step(self, batch, iteration):
        keys = [int(k) for k in batch["k"]]
        if 0 in keys:  # wait for the others: real synchronisation, not a guessed delay
            for _ in range(self.others):
                self.wait_on.get(timeout=120)  # the bound only keeps a lost mark from hanging the run
        if self.done is not None:
            for k in keys:
                self.done.put(k)
        return {"waited": [True] * len(keys)}


@pytest.mark.parametrize("channels", [True, False])
async def test_on_ray_a_call_worth_one_shard_waits_for_the_input_still_being_admitted(ray_cluster, channels):
    """The input is admitted in chunks of 16; a replica whose call's fixed cost outweighs the wait
    takes all 256 items in one call, not the first chunk alone (the GPU pool's 64 + 960)."""
    config = {"num_replicas": 1, "batch_size": 256, "call_cost": {"fixed_s": 1.0, "per_sample_s": 1e-4}, **CPU}
    one = Scale("one", config, srcs=["x"], dst="y")
    pipeline = {"backend": "ray", "input_chunk": 16, "local_channels": channels}
    async with flowrl.open_pipeline(lambda x: one.forward_step(x), pipeline) as pipe:
        out = await pipe.run(items(256))
        stage = pipe.stats().stages["one.forward_step"]
    assert [float(s["y"][0]) for s in out] == list(range(256))
    assert (stage.calls, stage.max_shard) == (1, 256)


async def test_outputs_in_input_order_by_default_and_as_completed_on_request(ray_cluster):
    from ray.util.queue import Queue

    # prefetch=1: no second shard waits inside the replica that holds sample 0
    config = {"num_replicas": 3, "batch_size": 1, "prefetch": 1, **CPU}
    keyed = [{"k": i} for i in range(6)]
    done, delivered = Queue(actor_options={"num_cpus": 0}), Queue(actor_options={"num_cpus": 0})
    try:
        last = LastOne("last", config, others=5, wait_on=done, done=done)
        async with flowrl.open_pipeline(lambda x: last.forward_step(x)) as pipe:
            ordered = [s.id for s in await pipe.run(keyed)]
        assert ordered == list(range(6))  # sample 0 finished last, yet comes first
        # As completed: sample 0 finishes only once the five others have reached this loop.
        last = LastOne("last", config, others=5, wait_on=delivered)
        completed = []
        async with flowrl.open_pipeline(lambda x: last.forward_step(x)) as pipe:
            async for s in pipe.stream(keyed, ordered=False):
                completed.append(s.id)
                await delivered.put_async(s.id)
    finally:
        done.shutdown()
        delivered.shutdown()
    assert sorted(completed) == list(range(6)) and completed[-1] == 0


async def test_user_exception_names_stage_replica_and_samples_and_cleans_up(ray_cluster):
    ok = Scale("ok", {"num_replicas": 2, "batch_size": 2, **CPU}, srcs=["x"], dst="y")
    bad = Fail("bad", {"num_replicas": 2, "batch_size": 2, **CPU}, bad_id=5)

    def flow(x):
        return bad.forward_step(ok.forward_step(x))

    with pytest.raises(flowrl.StageError) as info:
        async with flowrl.open_pipeline(flow) as pipe:
            await pipe.run(items(12))
    err = info.value
    assert err.stage == "bad.forward_step"
    assert err.replica in (0, 1)
    assert 5 in err.sample_ids and len(err.sample_ids) <= 2
    assert "ValueError: bad sample 5" in str(err)
    shown = "".join(traceback.format_exception(err))
    # the replica's traceback is chained: the user's frame and the original exception show
    assert 'raise ValueError(f"bad sample {self.bad_id}")' in shown and "ValueError: bad sample 5" in shown
    assert flowrl_actor_names() == []


@pytest.mark.parametrize(
    "fields, message",
    [({"y": 1}, "field 'y' must have"), ({"x": 0}, "already has")],
    ids=["wrong-length", "overwrite"],
)
async def test_malformed_output_is_an_output_error(ray_cluster, fields, message):
    emit = Emit("emit", {"num_replicas": 2, "batch_size": 3, **CPU}, fields=fields)
    with pytest.raises(flowrl.OutputError, match=message) as info:
        async with flowrl.open_pipeline(lambda x: emit.forward_step(x)) as pipe:
            await pipe.run(items(7))
    assert info.value.stage == "emit.forward_step" and info.value.sample_ids
    assert flowrl_actor_names() == []


async def test_two_undeclared_writers_of_one_field_are_rejected_when_data_shows_it(ray_cluster):
    p = Emit("p", {"num_replicas": 1, **CPU}, fields={"logits": 0})
    q = Emit("q", {"num_replicas": 1, **CPU}, fields={"logits": 0})
    join = Scale("join", {"num_replicas": 1, **CPU}, srcs=["x"], dst="j")

    def flow(x):
        return join.forward_step(p.forward_step(x), q.forward_step(x))

    with pytest.raises(flowrl.FlowDefinitionError, match=r"'logits'.*'p\.forward_step'|'logits'.*'q\.forward_step'"):
        async with flowrl.open_pipeline(flow) as pipe:
            await pipe.run(items(4))
    assert flowrl_actor_names() == []


async def test_a_declared_read_nobody_writes_fails_before_any_actor_starts(ray_cluster, monkeypatch):
    from flowrl._backends.ray_backend import RayBackend

    async def no_start(self, specs):
        raise AssertionError("replicas were started for a flow that should be rejected first")

    monkeypatch.setattr(RayBackend, "start", no_start)

    class Reader(flowrl.Model):
        @flowrl.step(reads=["response"], writes=["score"])
        def forward_step(self, batch, iteration):
            return {"score": batch["response"]}

    reader = Reader("reader", {"num_replicas": 1, **CPU})
    with pytest.raises(flowrl.FlowDefinitionError, match=r"'reader\.forward_step' reads field\(s\) \['response'\]"):
        async with flowrl.open_pipeline(lambda x: reader.forward_step(x), input_fields=["prompt"]):
            pass  # never reached: the flow is rejected when it is built
    assert flowrl_actor_names() == []


async def test_cancelling_mid_stream_stops_every_actor(ray_cluster):
    slow = Scale("slow", {"num_replicas": 2, "batch_size": 1, **CPU}, srcs=["x"], dst="y", sleep_s=0.05)
    seen = []
    with anyio.CancelScope() as scope:
        async with flowrl.open_pipeline(lambda x: slow.forward_step(x)) as pipe:
            async for s in pipe.stream(items(50)):
                seen.append(s.id)
                if len(seen) == 3:
                    scope.cancel()
    assert scope.cancelled_caught and seen == [0, 1, 2]
    assert flowrl_actor_names() == []


async def test_replicas_get_their_logical_gpus_and_see_who_they_are(ray_cluster):
    class WhoAmI(flowrl.Model):
        def forward_step(self, batch, iteration):
            n = len(batch)
            return {
                "gpus": [tuple(self.gpu_ids)] * n,
                "rid": [self.replica_id] * n,
                "dev": [str(self.device)] * n,
                "nrep": [self.num_replicas] * n,
                "bs": [self.config.batch_size] * n,
                "nm": [self.name] * n,
            }

    # ChatLearn sizing: 8 GPUs, tensor parallel 4 -> 2 replicas holding 4 GPUs each
    who = WhoAmI("who", {"num_gpu": 8, "tensor_parallel_size": 4, "batch_size": 3, **CPU})
    async with flowrl.open_pipeline(lambda x: who.forward_step(x)) as pipe:
        out = await pipe.run(items(12))
    per_replica = {s["rid"]: s["gpus"] for s in out}
    assert sorted(per_replica) == [0, 1]
    assert all(len(g) == 4 for g in per_replica.values())
    assert set(per_replica[0]).isdisjoint(per_replica[1])
    assert {s["dev"] for s in out} == {"cpu"}  # logical GPUs, no CUDA on this machine
    assert {(s["nrep"], s["bs"], s["nm"]) for s in out} == {(2, 3, "who")}


async def test_pools_larger_than_the_cluster_fail_fast_with_what_to_change(ray_cluster):
    greedy = Scale("greedy", {"num_replicas": 3, "gpus_per_replica": 4, **CPU}, srcs=["x"])
    with pytest.raises(flowrl.ClusterError, match=r"need 12 GPU .*has 8.*gpus_per_replica"):
        async with flowrl.open_pipeline(lambda x: greedy.forward_step(x)):
            pass
    assert flowrl_actor_names() == []


def test_sync_helper_runs_several_rounds_and_reports_stats(ray_cluster):
    m = Scale("m", {"num_replicas": 3, "batch_size": 4, **CPU}, srcs=["x"], dst="y", factor=2)
    with flowrl.Pipeline(lambda x: m.forward_step(x)) as pipe:
        first = pipe.run(items(10))
        second = pipe.run(items(7, start=10))
        stats = pipe.stats()
    assert [s.id for s in first + second] == list(range(17))
    assert all(np.allclose(s["y"], 2 * s.id) for s in first + second)
    st = stats["m.forward_step"]
    assert st.samples == 17 == sum(r.samples for r in st.replicas)
    assert st.calls == sum(r.calls for r in st.replicas) and st.max_shard <= 4
    assert st.overhead_s > 0  # every call pays a round trip outside the step
    assert all(r.busy_s >= 0 and r.idle_s >= 0 for r in st.replicas)
    assert stats.active_s > 0
    assert flowrl_actor_names() == []


def _spy_backend(monkeypatch) -> tuple[list, list, list]:
    from flowrl._backends.ray_backend import RayBackend

    put, fetched, pieces = [], [], []
    real_put, real_fetch, real_call = RayBackend.put, RayBackend.fetch, RayBackend.call

    def spy_put(self, batch):
        put.append(batch.keys())
        return real_put(self, batch)

    async def spy_fetch(self, refs):
        out = await real_fetch(self, refs)
        fetched.extend(b.keys() for b in out)
        return out

    async def spy_call(self, replica, call):
        pieces.extend(call.pieces)
        return await real_call(self, replica, call)

    monkeypatch.setattr(RayBackend, "put", spy_put)
    monkeypatch.setattr(RayBackend, "fetch", spy_fetch)
    monkeypatch.setattr(RayBackend, "call", spy_call)
    return put, fetched, pieces


def _two_stage_flow():
    first = Scale("first", {"num_replicas": 2, "batch_size": 3, **CPU}, srcs=["x"], dst="big")
    second = Scale("second", {"num_replicas": 2, "batch_size": 2, **CPU}, srcs=["big"], dst="score", factor=0.5)
    return lambda x: second.forward_step(first.forward_step(x))


async def test_big_payloads_go_replica_to_replica_and_the_driver_fetches_only_what_it_returns(ray_cluster, monkeypatch):
    from flowrl._backends.ray_wire import INLINE_BYTES, SMALL_BYTES

    put, fetched, pieces = _spy_backend(monkeypatch)
    width = max(SMALL_BYTES, INLINE_BYTES // 9) // 8 + 1  # x and big are over what rides inline
    data = [{"x": np.full(width, float(i))} for i in range(9)]
    assert 9 * width * 8 > INLINE_BYTES
    async with flowrl.open_pipeline(_two_stage_flow()) as pipe:
        out = await pipe.run(data, fields=["score"])
    assert [sorted(s) for s in out] == [["score"]] * 9 and all(np.allclose(s["score"], s.id / 2) for s in out)
    assert put and all(keys == {"x"} for keys in put)  # the driver only stores the input
    assert all(isinstance(p.ref, ray_cluster.ObjectRef) for p in pieces)  # shards are references
    assert {p.producer for p in pieces} == {"input", "first.forward_step"}
    assert fetched and all("big" not in keys and "score" in keys for keys in fetched)


@pytest.mark.parametrize("channels", [True, False])
async def test_small_payloads_ride_inside_the_calls(ray_cluster, monkeypatch, channels):
    from flowrl._backends.ray_wire import Inline as _Inline
    from flowrl._backends.ray_wire import Reply as _Reply

    put, fetched, pieces = _spy_backend(monkeypatch)
    async with flowrl.open_pipeline(_two_stage_flow(), {"local_channels": channels}) as pipe:
        out = await pipe.run(items(9), fields=["score"])
    assert all(np.allclose(s["score"], s.id / 2) for s in out)
    inputs = [p for p in pieces if p.producer == "input"]
    upstream = [p for p in pieces if p.producer == "first.forward_step"]
    assert inputs and all(isinstance(p.ref, _Inline) for p in inputs)  # never in shared memory
    # inside the reply: a Ray call's (object reference and bytes) or the channel's (rows)
    assert upstream and all(isinstance(p.ref, _Inline if channels else _Reply) for p in upstream)
    assert fetched and all("big" not in keys and "score" in keys for keys in fetched)


async def test_a_replica_process_that_dies_fails_the_run_with_its_shard_named(ray_cluster):
    # prefetch=1: the dying replica holds one shard (with prefetch 2 a queued one dies too)
    crash = Fail("crash", {"num_replicas": 2, "batch_size": 2, "prefetch": 1, **CPU}, bad_id=4, how="exit")
    with pytest.raises(flowrl.ReplicaDiedError) as info:
        async with flowrl.open_pipeline(lambda x: crash.forward_step(x)) as pipe:
            await pipe.run(items(10))
    assert info.value.stage == "crash.forward_step" and 4 in info.value.sample_ids
    assert flowrl_actor_names() == []


async def test_setup_failure_names_the_model_and_replica(ray_cluster):
    broken = Fail("broken", {"num_replicas": 2, **CPU}, how="setup")
    with pytest.raises(flowrl.StageError, match=r"stage 'broken\.setup', replica \d.*cannot set up replica"):
        async with flowrl.open_pipeline(lambda x: broken.forward_step(x)):
            pass
    assert flowrl_actor_names() == []
