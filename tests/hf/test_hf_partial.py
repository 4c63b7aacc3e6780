"""Partial rollouts with the Hugging Face policy: ``HFPolicy.continue_step`` in a loop writes a
response a few tokens a call, each call encoding the prompt and the response so far again; with
greedy decoding the segments join into the very response one call would have written."""

from __future__ import annotations

from typing import Any

import hf_tiny
import msgspec
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


@pytest.mark.parametrize("backend", ["inprocess", pytest.param("ray", marks=pytest.mark.slow)])
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


def masked_samples(garbage: float) -> tuple[list[int], list[dict[str, Any]]]:
    """Two groups of 2 responses; tokens 2-3 of each response are a tool's (loss_mask 0), their
    old and reference log-probs ``garbage``."""
    g = torch.Generator().manual_seed(1)
    samples = []
    for prompt_index in range(2):
        prompt = torch.randint(5, 300, (4,), generator=g)
        for k in range(2):
            n = 6 + k
            old = -torch.rand(n, generator=g)
            mask = torch.ones(n)
            mask[2:4] = 0
            old[2:4] = garbage
            samples.append(
                {
                    "prompt_ids": prompt,
                    "response_ids": torch.randint(5, 300, (n,), generator=g),
                    "logprobs": old,
                    "ref_logprobs": old.clone(),
                    "loss_mask": mask,
                    "score": float(k),
                    "prompt_index": prompt_index,
                }
            )
    return list(range(len(samples))), samples


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_tokens_a_tool_wrote_count_in_no_loss(tokenizer, aggregation):
    import hf_ranks

    case = {"aggregation": aggregation, "lr": 1e-3, "eps": 1e-6, "micro_batch_tokens": 0, "fsdp": "never"}
    case |= {"global_batch": 4, "micro_batch": 2}
    weights = []
    for garbage in (-50.0, 3.0):
        trainer = hf_ranks.make_trainer(tokenizer, case)
        trainer.grpo = msgspec.structs.replace(trainer.grpo, kl_coef=0.1)
        batch = flowrl.Batch.from_samples(*masked_samples(garbage))
        assert trainer.global_counts(batch).tokens == sum(int(m.sum()) for m in batch["loss_mask"]) == 18
        trainer.train_step(batch, 0)
        weights.append({k: v.detach().clone() for k, v in trainer.get_weights().items()})
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name  # the tool's tokens changed nothing


def test_continue_step_marks_its_own_tokens_in_the_loss_mask(tokenizer):
    parts = policy(tokenizer, {"batch_size": 3}, max_new_tokens=3, max_response_tokens=7)

    def flow(x):
        return flowrl.loop(parts.continue_step, x, until="finished", max_turns=10)

    items = [{"prompt": p, "response_ids": [], "logprobs": [], "loss_mask": []} for p in PROMPTS[:3]]
    out, _ = flowrl.run_flow(flow, items, {"backend": "inprocess"})
    for s in out:
        assert s["loss_mask"].tolist() == [1.0] * len(s["response_ids"])


def test_continue_step_refuses_a_prompt_that_leaves_no_room_for_the_whole_response(tokenizer):
    long = policy(tokenizer, {}, max_new_tokens=4, max_response_tokens=100)  # the tiny model's context: 128

    def flow(x):
        return flowrl.loop(long.continue_step, x, until="finished", max_turns=30)

    items = [{"prompt": " ".join(["seven eight nine ten"] * 10), "response_ids": [], "logprobs": []}]
    with pytest.raises(
        flowrl.StageError, match=r"more than 28 \(Sampling.max_prompt_tokens, or the context less max_resp"
    ):
        flowrl.run_flow(flow, items, {"backend": "inprocess"})
