"""``AsyncPipeline.run(ids=...)``: a run of some items under ids of the caller's choosing draws
what those samples drew in a run numbered as usual (their random streams follow the id)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flowrl

PIPELINE = {"backend": "inprocess", "inprocess_threads": True, "seed": 3}


class Draw(flowrl.Model):
    @flowrl.step
    def draw(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"x": [torch.rand(1, generator=g).item() for g in batch.generators()], "it": [iteration] * len(batch)}


async def test_items_run_again_under_their_ids_draw_the_same():
    model = Draw("draw", {"num_replicas": 2, "batch_size": 3})
    items = [{"k": i} for i in range(10)]
    async with flowrl.open_pipeline(model.draw, PIPELINE) as pipe:
        whole = await pipe.run(items)
        odd = await pipe.run(items[1::2], ids=[whole[i].id for i in range(1, 10, 2)])
        even = await pipe.run(items[0::2], ids=[whole[i].id for i in range(0, 10, 2)])
        later = await pipe.run(items[:2])  # numbered on from the run that was numbered last
    assert [s.id for s in odd] == [1, 3, 5, 7, 9]  # delivered in the order of the items given
    assert [s["x"] for s in odd] == [whole[i]["x"] for i in range(1, 10, 2)]
    assert [s["x"] for s in even] == [whole[i]["x"] for i in range(0, 10, 2)]
    assert [s["it"] for s in odd] == [1] * 5 and [s["it"] for s in even] == [2] * 5  # each run its iteration
    assert [s.id for s in later] == [10, 11]
    assert {s["x"] for s in later}.isdisjoint(s["x"] for s in whole)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([0, 1], "expected one id per item \\(3\\), got 2"),
        ([0, 1, 1], "ids must be distinct; \\[1\\] repeat"),
        ([0, -1, 2], "ids must be ints >= 0, got \\[-1\\]"),
        ([0, True, 2], "ids must be ints >= 0, got \\[True\\]"),
        ("abc", "expected a list of ints, one per item, got"),
    ],
)
async def test_bad_ids_are_refused_before_anything_runs(ids, message):
    model = Draw("draw", {"num_replicas": 1, "batch_size": 3})
    async with flowrl.open_pipeline(model.draw, PIPELINE) as pipe:
        with pytest.raises(flowrl.ConfigError, match=message):
            await pipe.run([{"k": i} for i in range(3)], ids=ids)
        assert [s.id for s in await pipe.run([{"k": 0}])] == [0]  # nothing was admitted


async def test_ids_need_items_with_a_length():
    model = Draw("draw", {"num_replicas": 1, "batch_size": 3})
    async with flowrl.open_pipeline(model.draw, PIPELINE) as pipe:
        with pytest.raises(flowrl.ConfigError, match="ids need items with a length"):
            await pipe.run(iter([{"k": 0}]), ids=[0])
