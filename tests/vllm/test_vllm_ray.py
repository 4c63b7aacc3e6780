"""flowrl.vllm on Ray: two policy replicas, each a vLLM engine inside its actor, fed by a GRPO
trainer's weights by host after every step; the engine's log-probs are the trainer's, so each
step's ratio is 1 only if the weights arrived. Nothing is left running after the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

import hf_ranks
import hf_tiny
import pytest

import flowrl
from flowrl import hf
from flowrl.testing import flowrl_actor_names

if TYPE_CHECKING:
    from pathlib import Path

pytest.importorskip("vllm")

from flowrl.vllm import VLLMPolicy  # noqa: E402  (after the skip: needs vllm)

CPU = {"cpus_per_replica": 0.5}
# vLLM's CPU attention takes heads of 32 or more
ARCH = hf_tiny.llama(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
def test_grpo_on_ray_syncs_the_trainers_weights_into_every_engine(ray_cluster, tmp_path: Path) -> None:
    lm = {"config": ARCH, "tokenizer": hf_tiny.make_tokenizer(tmp_path / "tok"), "seed": 3}
    sampling = {"max_new_tokens": 6, "stop_token_ids": tuple(range(5, 45))}
    policy = VLLMPolicy("policy", {"num_replicas": 2, "batch_size": 4, **CPU}, lm=lm, sampling=sampling)
    reward = hf.RuleReward("reward", {"batch_size": 8, **CPU}, fn=hf_ranks.e_count)
    trainer = hf.GRPOTrainer("grpo", {"num_replicas": 1, **CPU}, lm=lm, optim={"lr": 3e-2})
    config = flowrl.RunConfig(
        sample_per_episode=16,
        num_samples_per_prompt=4,
        num_episode=3,
        train_global_batch_size=16,  # one optimizer step an episode: its ratio is 1 iff the sync worked
        progress="off",
        pipeline=flowrl.PipelineConfig(backend="ray"),
    )
    engine = hf_ranks.grpo_engine(policy, reward, trainer, config)
    stats = engine.learn()
    metrics = [e.metrics["grpo"] for e in stats.episodes]
    for m in metrics:  # the engines' log-probs (float32, both replicas) are the trainer's own
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["clip_fraction"] == 0.0, m
    assert max(m["grad_norm"] for m in metrics) > 1e-3  # the steps moved the weights
    assert stats.episodes[-1].weight_versions == {"policy": 3}
    assert flowrl_actor_names() == []
