"""The trainer's own log-probs as the ratio's reference (``old_logprobs="recompute"``), for a
policy on an inference engine whose numbers differ from the trainer's: the ratio starts at 1
whatever the rollout's log-probs say, ``tis_cap`` weighs each token by the capped ratio of the
trainer's probability to the rollout's, and the settings that cannot work are refused."""

from __future__ import annotations

from typing import Any

import hf_tiny
import pytest
import torch

import flowrl
from flowrl import ConfigError, hf

pytest.importorskip("transformers")


def trainer(tokenizer: str, **grpo: Any) -> hf.GRPOTrainer:
    t = hf.GRPOTrainer(
        "t",
        lm={"config": hf_tiny.llama(), "tokenizer": tokenizer, "seed": 1},
        grpo={"clip": 0.2, **grpo},
        optim={"lr": 1e-3},
    )
    t.setup()
    t.global_batch_size = 4
    return t


def batch(t: hf.GRPOTrainer, shift: float) -> flowrl.Batch:
    """Four responses to two prompts; the rollout's log-probs are the trainer's own plus
    ``shift`` per token (an engine whose numbers are off)."""
    g = torch.Generator().manual_seed(0)
    samples: list[dict[str, Any]] = []
    for i in range(4):
        prompt = torch.randint(5, 300, (4,), generator=g)
        response = torch.randint(5, 300, (3 + i,), generator=g)
        samples.append({"prompt_ids": prompt, "response_ids": response, "score": float(i % 2), "prompt_index": i // 2})
    b = flowrl.Batch.from_samples(list(range(4)), samples)
    with torch.no_grad():
        own, _ = t.logprobs(b)
    rollout = [row[: len(s["response_ids"])] + shift for row, s in zip(own, samples, strict=True)]
    return flowrl.Batch.from_samples(
        list(range(4)), [{**s, "logprobs": r} for s, r in zip(samples, rollout, strict=True)]
    )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return hf_tiny.make_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def test_recomputed_log_probs_start_the_ratio_at_one_whatever_the_rollout_says(tokenizer: str) -> None:
    off = 0.5  # the rollout's probabilities exp(0.5) = 1.65x the trainer's: ratio 0.61, clipped
    rollout = trainer(tokenizer).train_step(batch(trainer(tokenizer), off), 0)
    recomputed = trainer(tokenizer, old_logprobs="recompute").train_step(batch(trainer(tokenizer), off), 0)
    assert rollout["ratio_mean"] == pytest.approx(float(torch.exp(torch.tensor(-off))), rel=1e-4)
    assert rollout["clip_fraction"] > 0
    assert recomputed["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert recomputed["clip_fraction"] == 0
    assert recomputed["logprob_gap"] == pytest.approx(off, rel=1e-4)  # what the engine's numbers miss by


def test_tis_cap_scales_the_step_by_the_capped_ratio(tokenizer: str) -> None:
    """Every token's weight is exp(-shift) (the rollout's probability above the trainer's): the
    loss, and so the gradient, is the unweighted one times that weight."""
    shift = 0.3
    plain = trainer(tokenizer, old_logprobs="recompute")
    weighted = trainer(tokenizer, old_logprobs="recompute", tis_cap=2.0)
    out_plain = plain.train_step(batch(plain, shift), 0)
    out = weighted.train_step(batch(weighted, shift), 0)
    weight = float(torch.exp(torch.tensor(-shift)))
    assert out["tis_mean"] == pytest.approx(weight, rel=1e-4)
    assert out["tis_clip_fraction"] == 0
    assert out["dual_clip_fraction"] == out_plain["dual_clip_fraction"] == 0  # no dual clip asked for
    assert out["loss"] == pytest.approx(out_plain["loss"] * weight, rel=1e-4)
    capped = trainer(tokenizer, old_logprobs="recompute", tis_cap=1.1)
    low = capped.train_step(batch(capped, -0.3), 0)  # the trainer's probability 1.35x the rollout's: capped
    assert low["tis_mean"] == pytest.approx(1.1, rel=1e-5)
    assert low["tis_clip_fraction"] == 1.0


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"tis_cap": 2.0}, "needs GRPO.old_logprobs='recompute'"),
        ({"old_logprobs": "engine"}, "GRPO.old_logprobs"),
        ({"old_logprobs": "recompute", "tis_cap": 0.0}, "GRPO.tis_cap"),
    ],
)
def test_settings_that_cannot_work_are_refused(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        hf.GRPO(**settings)
    with pytest.raises(ConfigError, match=words.replace("GRPO", "PPO")):
        hf.PPO(**settings)


def test_ppo_passes_the_settings_to_its_ratio(tokenizer: str) -> None:
    lm = {"config": hf_tiny.llama(), "tokenizer": tokenizer}
    t = hf.PPOTrainer("p", lm=lm, ppo={"old_logprobs": "recompute", "tis_cap": 3.0})
    assert (t.grpo.old_logprobs, t.grpo.tis_cap) == ("recompute", 3.0)


def without_rollout_logprobs(b: flowrl.Batch) -> flowrl.Batch:
    """``b`` as an engine told not to compute log-probs writes it (``VLLMConfig.logprobs=False``)."""
    return b.only([name for name in b if name != "logprobs"])


def test_recomputing_needs_no_rollout_log_probs_and_steps_as_with_them(tokenizer: str) -> None:
    with_them = trainer(tokenizer, old_logprobs="recompute")
    without = trainer(tokenizer, old_logprobs="recompute")
    full = batch(with_them, 0.5)
    out = with_them.train_step(full, 0)
    bare = without.train_step(without_rollout_logprobs(full), 0)
    assert "logprob_gap" in out and "logprob_gap" not in bare  # nothing to compare the trainer's with
    assert bare["loss"] == pytest.approx(out["loss"], rel=1e-6)
    for a, b in zip(with_them.module.parameters(), without.module.parameters(), strict=True):
        assert torch.equal(a, b)  # the same step: the rollout's numbers only measured the gap


@pytest.mark.parametrize(
    ("grpo", "words"),
    [
        ({}, "GRPO.old_logprobs='rollout' needs"),
        ({"old_logprobs": "recompute", "tis_cap": 2.0}, "GRPO.tis_cap=2.0 needs"),
    ],
)
def test_a_step_that_reads_the_rollouts_log_probs_says_they_are_missing(
    tokenizer: str, grpo: dict[str, Any], words: str
) -> None:
    t = trainer(tokenizer, **grpo)
    with pytest.raises(ConfigError, match=words):
        t.train_step(without_rollout_logprobs(batch(t, 0.0)), 0)
