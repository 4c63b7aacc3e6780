"""Partial rollouts with the Hugging Face policy: ``HFPolicy.continue_step`` in a loop writes a
response a few tokens a call, each call encoding the prompt and the response so far again; with
greedy decoding the segments join into the very response one call would have written."""

from __future__ import annotations

from typing import Any

import hf_tiny
import pytest
import torch

import flowrl
from flowrl import hf
from flowrl.testing import flowrl_actor_names

PROMPTS = ["what is one plus two", "yes", "seven eight nine ten the answer is", "no", "the answer", "two"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return hf_tiny.make_tokenizer(tmp_path_factory.mktemp("tok"))


def policy(tokenizer: str, config: dict[str, Any], **sampling: Any) -> hf.HFPolicy:
    lm = hf.LM(config=hf_tiny.llama(), tokenizer=tokenizer, seed=3)
    return hf.HFPolicy("policy", config, lm=lm, sampling={"temperature": 0.0, **sampling})


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
def test_segments_of_a_greedy_response_join_into_the_one_call_response(ray_cluster, tokenizer, backend):
    whole = policy(tokenizer, {"num_replicas": 1, "batch_size": 6, "cpus_per_replica": 0.25}, max_new_tokens=10)
    parts = policy(
        tokenizer,
        {"num_replicas": 2, "batch_size": 2, "cpus_per_replica": 0.25},
        max_new_tokens=3,
        max_response_tokens=10,
    )
    config = {"backend": backend}
    items = [{"prompt": p} for p in PROMPTS]
    one, _ = flowrl.run_flow(lambda x: whole.forward_step(x), items, config)

    def flow(x):
        return flowrl.loop(parts.continue_step, x, until="finished", max_turns=10, name="segment")

    state = [{**item, "response_ids": [], "logprobs": []} for item in items]
    many, stats = flowrl.run_flow(flow, state, config)
    for a, b in zip(one, many, strict=True):
        assert b["response_ids"].tolist() == a["response_ids"].tolist()
        assert torch.allclose(b["logprobs"], a["logprobs"], atol=1e-4)
        assert b["segment_turns"] == max(1, -(-len(a["response_ids"]) // 3))  # ceil(length / 3) segments
        assert bool(b["finished"]) and b["finish_reason"] == a["finish_reason"]
    assert stats.loops["segment"].turns == sum(s["segment_turns"] for s in many)
    if backend == "ray":
        assert flowrl_actor_names() == []


def test_a_bad_max_response_tokens_is_refused():
    with pytest.raises(flowrl.ConfigError, match=r"Sampling.max_response_tokens must be > 0, got 0"):
        hf.Sampling(max_response_tokens=0)
