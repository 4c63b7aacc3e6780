"""Pipeline semantics on the in-process backend (fast; the Ray path has its own tests)."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

import flowrl
from flowrl._backends.inprocess import InProcessBackend
from flowrl._pipeline.admission import Admission
from flowrl._pipeline.runs import Runs
from flowrl.testing import Fail, Scale

INPROC = {"backend": "inprocess"}


def items(n: int) -> list[dict]:
    return [{"x": np.full(2, float(i))} for i in range(n)]


def chain():
    a = Scale("a", {"num_replicas": 2, "batch_size": 3}, srcs=["x"], dst="a_out", factor=2)
    b = Scale("b", {"num_replicas": 3, "batch_size": 2}, srcs=["a_out"], dst="b_out", factor=5)
    return lambda x: b.forward_step(a.forward_step(x))


async def test_fields_limit_what_comes_back_and_unknown_fields_are_named():
    async with flowrl.open_pipeline(chain(), INPROC) as pipe:
        out = await pipe.run(items(5), fields=["b_out"])
        assert [dict(s).keys() for s in out] == [{"b_out"}] * 5
        assert all(np.allclose(s["b_out"], 10 * s.id) for s in out)
        with pytest.raises(
            flowrl.FlowDefinitionError, match=r"\['c_out'\] are not in the flow's output; it has .*'b_out'"
        ):
            await pipe.run(items(2), fields=["b_out", "c_out"])


async def test_a_closed_pipeline_says_so_instead_of_hanging():
    async with flowrl.open_pipeline(chain(), INPROC) as pipe:
        await pipe.run(items(2))
    with pytest.raises(flowrl.PipelineClosedError, match="closed"):
        await pipe.run(items(2))
    with flowrl.Pipeline(chain(), INPROC) as sync_pipe:
        sync_pipe.run(items(1))
    with pytest.raises(flowrl.PipelineClosedError):
        sync_pipe.run(items(1))


async def test_a_stream_left_early_is_superseded_and_accounting_stays_exact():
    async with flowrl.open_pipeline(chain(), INPROC) as pipe:
        async for s in pipe.stream(items(20)):
            if s.id == 2:
                break  # no aclose(): the next stream supersedes this one
        out = await pipe.run(items(4))
        stats = pipe.stats()
    assert [s.id for s in out] == [20, 21, 22, 23]  # ids keep counting across runs
    for stage in ("a.forward_step", "b.forward_step"):
        # every admitted sample ran exactly once, the abandoned ones included
        assert stats[stage].samples == 24 == sum(r.samples for r in stats[stage].replicas)


def test_sync_pipeline_raises_the_stage_error_itself():
    bad = Fail("bad", {"num_replicas": 2, "batch_size": 2}, bad_id=3)
    for _ in range(5):  # the error must never turn into a cancellation on the way out
        with pytest.raises(flowrl.StageError) as info:
            with flowrl.Pipeline(lambda x: bad.forward_step(x), INPROC) as pipe:
                pipe.run(items(6))
        assert info.value.stage == "bad.forward_step" and 3 in info.value.sample_ids
    with pytest.raises(flowrl.StageError):
        flowrl.run_flow(lambda x: bad.forward_step(x), items(6), INPROC)


async def test_window_bounds_inflight_samples_and_generators_work():
    drawn = 0

    def gen():
        nonlocal drawn
        for i in range(30):
            drawn += 1
            yield {"x": np.array([float(i)])}

    w = Scale("w", {"num_replicas": 2, "batch_size": 4}, srcs=["x"])
    ids, gaps = [], []
    async with flowrl.open_pipeline(
        lambda x: w.forward_step(x), {**INPROC, "max_inflight": 5, "input_chunk": 3}
    ) as pipe:
        async for s in pipe.stream(gen()):
            ids.append(s.id)
            gaps.append(drawn - len(ids))  # drawn from the input, not yet handed back
    assert ids == list(range(30))
    assert max(gaps) <= 5 and max(gaps) > 0


async def test_setup_failure_in_process_is_a_stage_error_with_the_cause_chained():
    broken = Fail("broken", {"num_replicas": 2}, how="setup")
    with pytest.raises(flowrl.StageError, match=r"'broken\.setup', replica 0") as info:
        async with flowrl.open_pipeline(lambda x: broken.forward_step(x), INPROC):
            pass
    assert isinstance(info.value.__cause__, RuntimeError)


async def test_a_stage_reading_the_input_and_an_upstream_output_waits_for_both():
    a = Scale("a", {"num_replicas": 2, "batch_size": 2}, srcs=["x"], dst="a_out", factor=3, sleep_s=0.002)
    c = Scale("c", {"num_replicas": 2, "batch_size": 3}, srcs=["x", "a_out"], dst="c_out")
    async with flowrl.open_pipeline(
        lambda x: c.forward_step(x, a.forward_step(x)), {**INPROC, "inprocess_threads": True}
    ) as pipe:
        out = await pipe.run(items(11))
        stats = pipe.stats()
    assert all(np.allclose(s["c_out"], 4 * s.id) for s in out)
    assert stats["c.forward_step"].samples == 11


def test_sync_run_after_a_failed_one_raises_instead_of_hanging():
    slow = Scale("slow", {"num_replicas": 2, "batch_size": 1}, srcs=["x"], sleep_s=0.01)
    bad = Fail("bad", {"num_replicas": 1, "batch_size": 1}, bad_id=5)
    with pytest.raises(flowrl.FlowError):
        with flowrl.Pipeline(
            lambda x: bad.forward_step(slow.forward_step(x)), {**INPROC, "inprocess_threads": True}
        ) as pipe:
            with pytest.raises(flowrl.FlowDefinitionError):
                pipe.run(items(8), fields=["nope"])  # fails at the first sample; others still run
            pipe.run(items(8))  # waits for the previous run, which meets sample 5 and fails


async def test_concurrent_streams_supersede_instead_of_mixing_samples():
    m = Scale("m", {"num_replicas": 2, "batch_size": 2}, srcs=["x"], dst="y", sleep_s=0.001)
    results: dict[str, object] = {}
    async with flowrl.open_pipeline(lambda x: m.forward_step(x), {**INPROC, "inprocess_threads": True}) as pipe:

        async def consume(name, n):
            try:
                results[name] = [s.id for s in await pipe.run(items(n))]
            except flowrl.PipelineClosedError as err:
                results[name] = err

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, "first", 6)
            tg.start_soon(consume, "second", 5)
        stats = pipe.stats()
    finished = [v for v in results.values() if isinstance(v, list)]
    assert finished, results  # the last stream to start completes, with ids of its own only
    assert all(ids == list(range(ids[0], ids[0] + len(ids))) for ids in finished)
    assert stats["m.forward_step"].samples <= 11


async def test_an_async_source_that_waits_for_results_is_not_starved():
    m = Scale("m", {"num_replicas": 2, "batch_size": 4}, srcs=["x"], dst="y")
    got = anyio.Event()
    out = []

    async def feedback():
        for i in range(4):  # the next prompt only after the previous result came back
            yield {"x": np.array([float(i)])}
            await got.wait()

    async with flowrl.open_pipeline(lambda x: m.forward_step(x), INPROC) as pipe:
        with anyio.fail_after(20):
            async for s in pipe.stream(feedback()):
                out.append(s.id)
                got.set()
                got = anyio.Event()
    assert out == [0, 1, 2, 3]


async def test_an_input_that_raises_surfaces_as_its_own_error_and_time_is_counted_once():
    m = Scale("m", {"num_replicas": 2, "batch_size": 2}, srcs=["x"])

    def broken():
        yield {"x": np.zeros(1)}
        raise ValueError("the dataset broke")

    with pytest.raises(ValueError, match="the dataset broke"):
        async with flowrl.open_pipeline(lambda x: m.forward_step(x), INPROC) as pipe:
            await pipe.run(broken())
    async with flowrl.open_pipeline(lambda x: m.forward_step(x), INPROC) as pipe:
        start = time.perf_counter()
        async for s in pipe.stream(items(20)):
            if s.id == 1:
                break  # left open: superseded by the next run
        await pipe.run(items(5))
        wall = time.perf_counter() - start
        assert pipe.stats().active_s <= wall


async def test_stats_count_shard_sizes_and_output_bytes_per_stage():
    async with flowrl.open_pipeline(chain(), INPROC) as pipe:
        await pipe.run(items(11))
        stats = pipe.stats()
    for stage, batch in (("a.forward_step", 3), ("b.forward_step", 2)):
        st = stats[stage]
        assert sum(st.shard_sizes.values()) == st.calls
        assert sum(size * n for size, n in st.shard_sizes.items()) == st.samples == 11
        assert max(st.shard_sizes) == st.max_shard <= batch
        # each sample adds a float64 pair (16 bytes) and Scale's three counters (8+ bytes each)
        assert st.out_bytes == sum(r.out_bytes for r in st.replicas) >= 11 * (16 + 3 * 8)
        assert st.overhead_s == pytest.approx(sum(r.overhead_s for r in st.replicas)) and st.overhead_s >= 0


async def test_a_cost_field_runs_the_costliest_samples_first():
    one = Scale("one", {"num_replicas": 1, "batch_size": 1, "prefetch": 1}, srcs=["x"], dst="y")
    costs = [3.0, 7.0, 1.0, 7.5, 2.0]
    data = [{"x": np.full(2, float(i)), "cost": c} for i, c in enumerate(costs)]
    config = {**INPROC, "cost_field": "cost", "input_chunk": 8}
    async with flowrl.open_pipeline(lambda x: one.forward_step(x), config) as pipe:
        out = await pipe.run(data)
    assert [s.id for s in out] == [0, 1, 2, 3, 4]  # delivered in input order all the same
    ran = sorted(out, key=lambda s: s["one_consumed"])  # the replica's running count
    assert [s.id for s in ran] == [3, 1, 0, 4, 2]


@pytest.mark.parametrize("value, got", [(None, "no such field"), ("long", "a str"), (True, "a bool")])
async def test_a_cost_field_that_is_not_a_number_is_named(value, got):
    one = Scale("one", {"num_replicas": 1, "batch_size": 1}, srcs=["x"], dst="y")
    data = [{"x": np.zeros(2), "cost": 1.0}, {"x": np.zeros(2)} if value is None else {"x": np.zeros(2), "cost": value}]
    with pytest.raises(flowrl.FlowDefinitionError, match=f"input item 1: PipelineConfig.cost_field='cost' .*got {got}"):
        async with flowrl.open_pipeline(lambda x: one.forward_step(x), {**INPROC, "cost_field": "cost"}) as pipe:
            await pipe.run(data)


async def test_costs_given_to_a_run_order_it_and_replace_the_cost_field():
    one = Scale("one", {"num_replicas": 1, "batch_size": 1, "prefetch": 1}, srcs=["x"], dst="y")
    data = [{"x": np.full(2, float(i)), "cost": 100.0 - i} for i in range(70)]  # the field says: oldest first
    costs = [float(i % 7) for i in range(70)]
    # more items than input_chunk: a run with costs is admitted whole, so the order spans all 70
    async with flowrl.open_pipeline(lambda x: one.forward_step(x), {**INPROC, "cost_field": "cost"}) as pipe:
        out = await pipe.run(data, costs=costs)
    assert [s.id for s in out] == list(range(70))
    ran = [s.id for s in sorted(out, key=lambda s: s["one_consumed"])]
    assert ran == sorted(range(70), key=lambda i: (-costs[i], i))


READ = threading.Event()  # a model's replicas are copies: what they share lives here


class WaitsForReads(Scale):
    """Holds its step for sample 0 until ``READ`` is set (or 30 s pass); says which as
    ``released``."""

    def forward_step(self, batch: Any, iteration: int) -> dict[str, Any]:
        released = READ.wait(timeout=30) if 0 in batch.ids.tolist() else None
        return {**super().forward_step(batch, iteration), "released": [released] * len(batch)}


async def test_samples_done_ahead_of_their_turn_are_read_while_the_consumer_waits(monkeypatch):
    """With estimates the costliest samples run first, so the sample delivered first may
    finish last; the ones done before it are read (made Samples) while the consumer waits for
    it, not all at once after it, which put their reading on the run's critical path."""
    reads: list[int] = []
    READ.clear()
    materialize = Runs._materialize

    async def counted(self: Runs, sid: int, *args: Any) -> Any:
        reads.append(sid)
        if len(reads) == 5:
            READ.set()
        return await materialize(self, sid, *args)

    monkeypatch.setattr(Runs, "_materialize", counted)
    one = WaitsForReads("one", {"num_replicas": 1, "batch_size": 1, "prefetch": 1}, srcs=["x"], dst="y")
    config = {**INPROC, "inprocess_threads": True}
    async with flowrl.open_pipeline(lambda x: one.forward_step(x), config) as pipe:
        out = await pipe.run([{"x": np.full(2, float(i))} for i in range(6)], costs=[0.0, 5, 4, 3, 2, 1])
    assert out[0]["released"] is True  # samples 1-5 were read while sample 0 ran
    assert reads == [1, 2, 3, 4, 5, 0]  # each once, in the order they finished
    assert [s.id for s in out] == list(range(6)) and [float(s["y"][0]) for s in out] == [0, 1, 2, 3, 4, 5]


async def test_samples_of_one_reply_read_ahead_of_their_turn_read_it_once(monkeypatch):
    fetched: list[int] = []
    fetch = InProcessBackend.fetch

    async def counted(self: InProcessBackend, refs: list[Any]) -> Any:
        fetched.append(len(refs))
        return await fetch(self, refs)

    monkeypatch.setattr(InProcessBackend, "fetch", counted)
    one = Scale("one", {"num_replicas": 1, "batch_size": 4, "prefetch": 1}, srcs=["x"], dst="y")
    costs = [0.0] * 4 + [1.0] * 4  # samples 4-7 run first, in one shard, ahead of their turn
    async with flowrl.open_pipeline(lambda x: one.forward_step(x), {**INPROC, "input_chunk": 8}) as pipe:
        out = await pipe.run([{"x": np.full(2, float(i))} for i in range(8)], costs=costs)
    assert [s.id for s in out] == list(range(8)) and [float(s["y"][0]) for s in out] == list(range(8))
    assert [s["one_round"] for s in out] == [0] * 8
    assert sorted(s["one_consumed"] for s in out[4:]) == [4] * 4  # 4-7 were the first shard
    assert fetched == [2, 2]  # per shard one read of its reply and the input chunk, for its four samples


EVENTS: list[str] = []  # a model's replicas are copies: what they share lives here


class Logged(Scale):
    def forward_step(self, batch: Any, iteration: int) -> dict[str, Any]:
        EVENTS.append("step")
        return super().forward_step(batch, iteration)


async def test_the_first_shards_go_out_before_the_whole_input_is_admitted(monkeypatch):
    """Admission yields after each input chunk: a run's first calls need not wait for the
    rest of a long input to be admitted (400 items in 7 chunks took 4 ms on 2 cores)."""
    EVENTS.clear()
    admit_chunk = Admission._admit_chunk

    def logged(self: Admission, run: Any, chunk: list[Any], *, expected: bool) -> None:
        EVENTS.append("chunk")
        admit_chunk(self, run, chunk, expected=expected)

    monkeypatch.setattr(Admission, "_admit_chunk", logged)
    one = Logged("one", {"num_replicas": 2, "batch_size": 1}, srcs=["x"], dst="y")
    async with flowrl.open_pipeline(lambda x: one.forward_step(x), {**INPROC, "input_chunk": 4}) as pipe:
        out = await pipe.run([{"x": np.full(2, float(i))} for i in range(32)])
    assert [float(s["y"][0]) for s in out] == list(range(32))
    assert EVENTS.count("chunk") == 8 and EVENTS.count("step") == 32
    # the first step ran after a chunk or two (the dispatcher's turn on the loop), not after all eight
    assert EVENTS[: EVENTS.index("step")].count("chunk") <= 2


# one replica whose call's fixed cost (1 s) outweighs its 64 samples' (6.4 ms): one call is worth a wait
FIXED_COST_64 = {"num_replicas": 1, "batch_size": 64, "call_cost": {"fixed_s": 1.0, "per_sample_s": 1e-4}}


class Lying:
    """Items whose ``len()`` may promise more than they yield."""

    def __init__(self, claimed: int, given: int) -> None:
        self.claimed, self.given = claimed, given

    def __len__(self) -> int:
        return self.claimed

    def __iter__(self) -> Any:
        return iter([{"x": np.full(2, float(i))} for i in range(self.given)])


@pytest.mark.parametrize("claimed", [64, 1000])
async def test_a_call_whose_fixed_cost_outweighs_the_wait_takes_the_input_whole_not_its_first_chunk(claimed):
    """The window's room is admitted without any sample finishing, so the ``cost`` splitter waits
    for it where a call's fixed cost is worth more than the wait (the first chunk of 4 alone would
    pay it twice). An input that yields fewer items than its ``len()`` leaves no stage waiting."""
    one = Scale("one", FIXED_COST_64, srcs=["x"], dst="y")
    async with flowrl.open_pipeline(lambda x: one.forward_step(x), {**INPROC, "input_chunk": 4}) as pipe:
        out = await pipe.run(Lying(claimed, 64))
        stage = pipe.stats().stages["one.forward_step"]
    assert [float(s["y"][0]) for s in out] == list(range(64))
    assert (stage.calls, stage.max_shard) == (1, 64)


class ColdStart(Scale):
    """``Scale`` whose replica's first call takes ``cold_s`` longer, as a GPU's first kernels do."""

    def __init__(self, *args: Any, cold_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cold_s, self.started = cold_s, False

    def forward_step(self, batch: Any, iteration: int) -> dict[str, Any]:
        if not self.started:
            self.started = True
            time.sleep(self.cold_s)
        return super().forward_step(batch, iteration)


async def test_a_replicas_slow_first_call_does_not_split_the_next_run():
    """A first call 0.3 s slower once, slower than calls ten times its size, made the fit's line
    fall: the fixed cost went unseen, and the next run went in 7 calls of at most 48."""
    one = ColdStart(
        "one", {"num_replicas": 1, "batch_size": 256}, srcs=["x"], dst="y", sleep_s=0.2, per_sample_s=1e-3, cold_s=0.3
    )
    async with flowrl.open_pipeline(lambda x: one.forward_step(x), {**INPROC, "input_chunk": 16}) as pipe:
        await pipe.run(items(256))  # its first call cold
        first = pipe.stats().stages["one.forward_step"].calls
        out = await pipe.run(items(256))
        stage = pipe.stats().stages["one.forward_step"]
    assert [float(s["y"][0]) for s in out] == list(range(256))
    assert (stage.calls - first, stage.max_shard) == (1, 256)


async def test_a_wait_for_the_window_is_not_a_wait_of_the_splitter():
    """Only what the window holds when the run starts is counted on: the items beyond it need
    samples to finish first, so waiting for them would wait forever."""
    one = Scale("one", FIXED_COST_64, srcs=["x"], dst="y")
    pipeline = {**INPROC, "input_chunk": 4, "max_inflight": 16}
    async with flowrl.open_pipeline(lambda x: one.forward_step(x), pipeline) as pipe:
        out = await pipe.run(items(40))
        stage = pipe.stats().stages["one.forward_step"]
    assert [float(s["y"][0]) for s in out] == list(range(40))
    assert stage.max_shard == 16  # the window's 16 taken whole, then what each completion frees


@pytest.mark.parametrize(
    "costs, items, message",
    [
        ([1.0], [{"x": np.zeros(2)}] * 2, r"expected one cost per item \(2\), got 1"),
        ([1.0, -1.0], [{"x": np.zeros(2)}] * 2, r"finite numbers >= 0, got \[1\]=-1.0"),
        ([1.0, "a"], [{"x": np.zeros(2)}] * 2, "expected a number, got 'a'"),
        (5, [{"x": np.zeros(2)}], "expected a list of numbers, one per item, got int"),
        ([1.0], iter([{"x": np.zeros(2)}]), "costs need items with a length"),
    ],
)
def test_costs_that_do_not_fit_the_items_are_named(costs, items, message):
    one = Scale("one", {"num_replicas": 1, "batch_size": 1}, srcs=["x"], dst="y")
    with flowrl.Pipeline(lambda x: one.forward_step(x), INPROC) as pipe:
        with pytest.raises(flowrl.ConfigError, match=rf"Pipeline.run\(costs=\.\.\.\): .*{message}"):
            pipe.run(items, costs=costs)
