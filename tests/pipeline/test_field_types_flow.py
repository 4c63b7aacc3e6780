"""Field types through a running flow (in process): what a step sees does not depend on which
samples share its shard (the rule itself is tested in core/test_field_types.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import flowrl
from flowrl.testing import flowrl_actor_names

INPROC = {"backend": "inprocess"}


class Generate(flowrl.Model):
    """Responses of equal length for some prompts, different for others, always as a list."""

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        prompts = batch["prompt"]
        return {
            "response": [torch.arange(3 + int(p) // 4) for p in prompts],  # shards of 4 share a length
            "logprobs": torch.zeros(len(batch), 2),
        }


class Look(flowrl.Model):
    """Records what it was given: the kinds and dtypes a downstream step sees."""

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        seen = f"{type(batch['prompt']).__name__}:{batch['prompt'].dtype}|{type(batch['response']).__name__}"
        return {"seen": [seen] * len(batch), "shard": [len(batch)] * len(batch)}


def flow(sizes: tuple[int, int]):
    gen = Generate("gen", {"num_replicas": 2, "batch_size": sizes[0]})
    look = Look("look", {"num_replicas": 3, "batch_size": sizes[1]})
    return lambda x: look.forward_step(gen.forward_step(x))


@pytest.mark.parametrize("sizes", [(4, 4), (1, 3), (3, 8)], ids=["aligned", "small", "across"])
async def test_a_step_sees_the_same_kinds_whatever_its_shard(sizes):
    async with flowrl.open_pipeline(flow(sizes), INPROC) as pipe:
        out = await pipe.run([{"prompt": i} for i in range(16)])
    assert {s["seen"] for s in out} == {"ndarray:int64|list"}
    trained = flowrl.Batch.from_samples([s.id for s in out], out)  # the trainers' batch
    assert isinstance(trained["response"], list) and isinstance(trained["logprobs"], torch.Tensor)
    assert trained["prompt"].dtype == np.int64 and tuple(trained["logprobs"].shape) == (16, 2)
    lengths = [len(r) for r in flowrl.Batch.from_samples([s.id for s in out[:4]], out[:4])["response"]]
    assert lengths == [3, 3, 3, 3]  # equal lengths, and still a list


async def test_an_input_field_that_changes_type_between_chunks_is_refused():
    items = [{"prompt": 1}, {"prompt": 2}, {"prompt": 2.5}]
    with pytest.raises(flowrl.FlowDefinitionError, match=r"'prompt' of the input items .*int64.*float64"):
        async with flowrl.open_pipeline(flow((2, 2)), {**INPROC, "input_chunk": 1}) as pipe:
            await pipe.run(items)


async def test_an_input_field_keeps_its_type_across_the_runs_of_one_pipeline():
    """An engine's episodes are runs of one pipeline: int prompts in one run, then a float one
    in a later run, is the same drift as within a run, and is refused the same way."""
    done: list[int] = []
    with pytest.raises(flowrl.FlowDefinitionError, match=r"'prompt' of the input items .*int64.*float64"):
        async with flowrl.open_pipeline(flow((2, 2)), INPROC) as pipe:
            done.append(len(await pipe.run([{"prompt": i} for i in range(4)])))
            done.append(len(await pipe.run([{"prompt": i} for i in range(4, 8)])))  # same type: accepted
            await pipe.run([{"prompt": 0.5}] * 4)
    assert done == [4, 4]  # the first two runs went through; only the third was refused


class Drift(flowrl.Model):
    """Pads its output to a longer length at each call: a field whose shape changes."""

    def setup(self) -> None:
        self.calls = 0

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self.calls += 1
        return {"response": torch.zeros(len(batch), 1 + self.calls)}


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
async def test_a_stage_whose_tensor_changes_shape_fails_where_it_is_produced(backend, request):
    # The consumer takes one sample a call, so no gather ever joins two of the producer's
    # outputs: the driver finds the change in the producer's reports, whatever the shards.
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    drift = Drift("gen", {"num_replicas": 2, "batch_size": 2})
    look = Look("look", {"num_replicas": 1, "batch_size": 1})
    with pytest.raises(flowrl.OutputError) as info:
        async with flowrl.open_pipeline(lambda x: look.forward_step(drift.forward_step(x)), {"backend": backend}) as p:
            await p.run([{"prompt": i} for i in range(8)])  # 4+ calls on 2 replicas: one calls twice
    if backend == "ray":
        assert flowrl_actor_names() == []
    assert info.value.stage == "gen.forward_step"
    assert "field 'response' arrives as a float32 tensor of shape [n, 2]" in str(info.value)
    assert "float32 tensor of shape [n, 3]" in str(info.value) and "pad it to a fixed length" in str(info.value)
