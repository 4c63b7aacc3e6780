"""The Hugging Face policy samples each row from its sample's own stream: the same seed gives the
same generations on any replica count, shard size and backend; the draws follow the sampling
distribution (temperature, top-k) of ``generate``."""

from __future__ import annotations

import hf_tiny
import pytest
import torch

import flowrl
from flowrl import hf
from flowrl.hf.config import Sampling
from flowrl.hf.sampling import RowSampler

PROMPTS = ["what is one plus two", "yes", "seven eight nine ten the answer is", "no", "the answer", "two"] * 2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return hf_tiny.make_tokenizer(tmp_path_factory.mktemp("tok"))


def draws(sampling: Sampling, logits: torch.Tensor, n: int) -> torch.Tensor:
    """How often each index wins over ``n`` draws of one row."""
    row = RowSampler(sampling, [torch.Generator().manual_seed(0)])
    counts = torch.zeros(logits.shape[-1])
    for _ in range(n):
        counts[int(row(torch.zeros(1, 1, dtype=torch.long), logits.clone()).argmax())] += 1
    return counts / n


def test_the_row_sampler_draws_from_the_warped_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    for temperature in (1.0, 0.5):
        expected = torch.softmax(logits[0] / temperature, -1)
        assert torch.allclose(draws(Sampling(temperature=temperature), logits, 20_000), expected, atol=0.015)
    top2 = draws(Sampling(top_k=2), logits, 5_000)
    assert top2[2:].sum() == 0 and torch.allclose(top2[:2], torch.softmax(logits[0, :2], -1), atol=0.03)


def generations(
    tokenizer: str, backend: str, replicas: int, batch: int, seed: int = 0, sampling_seed: int = 0
) -> list[list[int]]:
    lm = hf.LM(config=hf_tiny.llama(), tokenizer=tokenizer, seed=3)
    policy = hf.HFPolicy(
        "policy",
        {"num_replicas": replicas, "batch_size": batch, "cpus_per_replica": 0.25},
        lm=lm,
        sampling={"max_new_tokens": 6, "temperature": 1.0, "seed": sampling_seed},
    )
    samples, _ = flowrl.run_flow(
        policy.forward_step, [{"prompt": p} for p in PROMPTS], {"backend": backend, "seed": seed}
    )
    return [s["response_ids"].tolist() for s in samples]


def test_the_same_seed_gives_the_same_generations_on_any_layout(ray_cluster, tokenizer):
    reference = generations(tokenizer, "inprocess", 1, 12)
    assert len({tuple(r) for r in reference}) > len(set(PROMPTS))  # sampled: a prompt's two samples differ
    assert generations(tokenizer, "inprocess", 3, 2) == reference
    assert generations(tokenizer, "ray", 2, 5) == reference
    assert generations(tokenizer, "inprocess", 1, 12, seed=1) != reference


def test_sampling_seed_moves_every_stream(tokenizer):
    reference = generations(tokenizer, "inprocess", 1, 12)
    moved = generations(tokenizer, "inprocess", 2, 4, sampling_seed=5)
    assert moved != reference and generations(tokenizer, "inprocess", 3, 4, sampling_seed=5) == moved
