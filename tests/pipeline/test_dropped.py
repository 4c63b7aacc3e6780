"""A sample dropped once its retries are spent (``ModelConfig.on_spent="drop"``): the run goes
on with the others, nothing waits for it, and a call of it still under way elsewhere ends
without effect. In process, with replicas in threads (a hung call is left in its thread)."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

import flowrl

STUCK = 3
RETRY = {"call_timeout_s": 2.0, "on_timeout": "retry", "on_spent": "drop"}  # a normal call: milliseconds
PIPELINE = {"backend": "inprocess", "inprocess_threads": True, "max_retries": 1}
EVENTS: dict[str, threading.Event] = {}  # by name: a model holds a name (its replicas are copies)


@pytest.fixture(autouse=True)
def events():
    EVENTS.update(hang=threading.Event(), other=threading.Event())
    yield EVENTS
    for event in EVENTS.values():  # hung calls left in their threads end
        event.set()


class Waits(flowrl.Model):
    """Either step's call holding sample STUCK waits for the event named ``release``: ``a``
    never answers in time; ``b`` (the other branch) runs until the test lets it end."""

    def __init__(self, name: str, config: dict[str, Any], release: str) -> None:
        super().__init__(name, config)
        self.release = release

    def _wait(self, batch: flowrl.Batch) -> None:
        if STUCK in batch.ids.tolist():
            EVENTS[self.release].wait(60)

    @flowrl.step
    def a(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self._wait(batch)
        return {"a": [v + 1 for v in batch["v"]]}

    @flowrl.step
    def b(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self._wait(batch)
        return {"b": [v * 2 for v in batch["v"]]}


class Join(flowrl.Model):
    @flowrl.step
    def c(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"c": [x + y for x, y in zip(batch["a"], batch["b"], strict=True)]}


@pytest.mark.parametrize("splitter", ["cost", "greedy"])
async def test_a_dropped_sample_with_a_call_under_way_on_another_branch_ends_cleanly(events, splitter):
    first = Waits("first", {"num_replicas": 2, "batch_size": 4, "splitter": splitter, **RETRY}, "hang")
    second = Waits("second", {"num_replicas": 1, "batch_size": 4, "splitter": splitter}, "other")
    join = Join("join", {"num_replicas": 1, "batch_size": 8, "splitter": splitter})
    n = 10
    out: list[flowrl.Sample] = []
    async with flowrl.open_pipeline(lambda x: join.c(first.a(x), second.b(x)), PIPELINE) as pipe:
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                out.extend(await pipe.run([{"v": i} for i in range(n)]))

            tg.start_soon(consume)
            # the drop is recorded while branch b still runs the sample (stats expose no event)
            with anyio.fail_after(60):  # a drop that never comes fails, not hangs
                while not pipe.stats().dropped:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            assert pipe.stats()["second.b"].samples < n
            events["other"].set()
        stats = pipe.stats()
        again = await pipe.run([{"v": i} for i in range(n)])  # ids from n on: none hangs
    kept = [i for i in range(n) if i != STUCK]
    assert [s.id for s in out] == kept
    assert [s["c"] for s in out] == [3 * i + 1 for i in kept]
    assert [(d.sample, d.stage, d.turn) for d in stats.dropped] == [(STUCK, "first.a", 0)]
    assert stats["first.a"].dropped == 1 and stats["first.a"].samples == n - 1
    assert stats["second.b"].samples == n  # its call of the dropped sample ended, its output unused
    assert stats["join.c"].samples == n - 1
    assert [s["c"] for s in again] == [3 * i + 1 for i in range(n)]


class Then(flowrl.Model):
    @flowrl.step
    def b2(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"b2": [x + 100 for x in batch["b"]]}

    @flowrl.step
    def c(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"c": [x + y for x, y in zip(batch["a"], batch["b2"], strict=True)]}


async def test_a_dropped_sample_leaves_once_its_other_branch_has_run_two_stages(events):
    first = Waits("first", {"num_replicas": 2, "batch_size": 4, "splitter": "greedy", **RETRY}, "hang")
    second = Waits("second", {"num_replicas": 1, "batch_size": 4, "splitter": "greedy"}, "other")
    then = Then("then", {"num_replicas": 1, "batch_size": 8, "splitter": "greedy"})
    n = 10
    out: list[flowrl.Sample] = []
    async with flowrl.open_pipeline(lambda x: then.c(first.a(x), then.b2(second.b(x))), PIPELINE) as pipe:
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                with anyio.fail_after(60):  # a sample left in the ledger would hang the run
                    out.extend(await pipe.run([{"v": i} for i in range(n)]))

            tg.start_soon(consume)
            with anyio.fail_after(60):
                while not pipe.stats().dropped:  # noqa: ASYNC110  (stats expose no event)
                    await anyio.sleep(0.01)
            events["other"].set()
        stats = pipe.stats()
    assert [s.id for s in out] == [i for i in range(n) if i != STUCK]
    assert stats["then.b2"].samples == n - 1 and stats["then.c"].samples == n - 1


async def test_a_sample_that_hangs_on_both_branches_is_dropped_once():
    first = Waits("first", {"num_replicas": 2, "batch_size": 4, "splitter": "greedy", **RETRY}, "hang")
    second = Waits("second", {"num_replicas": 2, "batch_size": 4, "splitter": "greedy", **RETRY}, "hang")
    join = Join("join", {"num_replicas": 1, "batch_size": 8, "splitter": "greedy"})
    n = 10
    async with flowrl.open_pipeline(lambda x: join.c(first.a(x), second.b(x)), PIPELINE) as pipe:
        with anyio.fail_after(60):
            out = await pipe.run([{"v": i} for i in range(n)])
        stats = pipe.stats()
        again = await pipe.run([{"v": i} for i in range(n)])  # the counts still add up: a run ends
    assert [s.id for s in out] == [i for i in range(n) if i != STUCK]
    assert [d.sample for d in stats.dropped] == [STUCK]  # recorded once, on the branch that gave up first
    assert stats["first.a"].dropped + stats["second.b"].dropped == 1
    assert stats["join.c"].samples == n - 1 and len(again) == n


@pytest.mark.parametrize("splitter", ["cost", "greedy"])
async def test_only_the_hanging_sample_is_dropped_when_calls_queue_behind_it(splitter):
    """With ``prefetch=2`` a call may wait behind the one that hangs, and fail with it: a
    suspect goes only to a replica with nothing in flight, and nothing waits behind it."""
    box = Waits("box", {"num_replicas": 2, "batch_size": 4, "splitter": splitter, "prefetch": 2, **RETRY}, "hang")
    n = 40
    async with flowrl.open_pipeline(box.a, PIPELINE) as pipe:
        out = await pipe.run([{"v": i} for i in range(n)])
        stats = pipe.stats()
    assert [(d.sample, d.stage) for d in stats.dropped] == [(STUCK, "box.a")]
    assert [s.id for s in out] == [i for i in range(n) if i != STUCK]


async def test_without_on_spent_the_run_fails_naming_the_sample():
    first = Waits("first", {"num_replicas": 2, "batch_size": 4, **RETRY, "on_spent": "fail"}, "hang")
    with pytest.raises(flowrl.ReplicaDiedError, match=r"max_retries=1") as caught:
        async with flowrl.open_pipeline(first.a, PIPELINE) as pipe:
            await pipe.run([{"v": i} for i in range(6)])
    assert caught.value.sample_ids == [STUCK] and caught.value.stage == "first.a"


def test_a_bad_on_spent_is_refused():
    with pytest.raises(flowrl.ConfigError, match=r"ModelConfig.on_spent must be one of \['fail', 'drop'\], got 'skip'"):
        flowrl.ModelConfig(on_spent="skip")
