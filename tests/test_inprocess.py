"""Pipeline semantics on the in-process backend (fast; the Ray path has its own tests)."""

from __future__ import annotations

import numpy as np
import pytest

import flowrl
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
        assert [dict(s) .keys() for s in out] == [{"b_out"}] * 5
        assert all(np.allclose(s["b_out"], 10 * s.id) for s in out)
        with pytest.raises(flowrl.FlowDefinitionError, match=r"\['c_out'\] are not in the flow's output; it has .*'b_out'"):
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
    async with flowrl.open_pipeline(lambda x: w.forward_step(x), {**INPROC, "max_inflight": 5, "input_chunk": 3}) as pipe:
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
