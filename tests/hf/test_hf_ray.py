"""flowrl.hf on Ray: two policy replicas, a GRPO trainer sharded by FSDP2 over two gloo ranks,
the weight sync by host, checkpoints gathered on every rank and a resume; and a bad tokenizer
that fails the engine by name, leaving no actor."""

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

CPU = {"cpus_per_replica": 0.5}


def make_engine(tokenizer: str, tmp: Path, episodes: int, resume: str = "auto") -> flowrl.Engine:
    lm = {"config": hf_tiny.llama(), "tokenizer": tokenizer}
    sampling = {"max_new_tokens": 6, "stop_token_ids": tuple(range(5, 45))}
    policy = hf.HFPolicy("policy", {"num_replicas": 2, "batch_size": 4, **CPU}, lm=lm, sampling=sampling)
    reward = hf.RuleReward("reward", {"batch_size": 8, **CPU}, fn=hf_ranks.e_count)
    trainer = hf.GRPOTrainer("grpo", {"num_replicas": 2, **CPU}, lm=lm, optim={"lr": 3e-2})
    config = flowrl.RunConfig(
        sample_per_episode=16,
        num_samples_per_prompt=4,
        num_episode=episodes,
        train_global_batch_size=16,  # one optimizer step an episode: its ratio is 1 iff the sync worked
        checkpoint={"every": 1, "keep": 0, "dir": str(tmp / "ckpt"), "resume": resume},
        progress="off",
    )
    engine = hf_ranks.grpo_engine(policy, reward, trainer, config)
    return engine


@pytest.mark.slow  # ~50 s: FSDP on Ray; the in-process and gloo hf tests cover the rest by default
def test_grpo_on_ray_with_a_sharded_trainer_syncs_checkpoints_and_resumes(ray_cluster, tmp_path: Path) -> None:
    tokenizer = hf_tiny.make_tokenizer(tmp_path / "tok")
    stats = make_engine(tokenizer, tmp_path, 3).learn()
    metrics = [e.metrics["grpo"] for e in stats.episodes]
    # each episode's one step starts from the weights its rollout was sampled with: the policy's
    # log-probs (2 replicas, loaded by host from the sharded trainer's gathered weights) are the trainer's
    for m in metrics:
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["clip_fraction"] == 0.0, m
    assert stats.episodes[-1].weight_versions == {"policy": 3}
    assert max(m["grad_norm"] for m in metrics) > 1e-3  # the steps moved the weights
    assert flowrl_actor_names() == []
    # a resume loads the gathered checkpoint into both shards and goes on where the run stopped
    resumed = make_engine(tokenizer, tmp_path / "again", 3, resume=str(tmp_path / "ckpt" / "episode-000001"))
    again = [e.metrics["grpo"] for e in resumed.learn().episodes]
    assert len(again) == 3 and again[2]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert flowrl_actor_names() == []


def test_a_tokenizer_without_a_pad_token_fails_the_engine_by_name_and_leaves_no_actor(
    ray_cluster, tmp_path: Path
) -> None:
    folder = hf_tiny.make_tokenizer(tmp_path / "nopad", pad=False)
    # the policy and the trainer load the same tokenizer: whichever fails first names itself
    no_pad = r"model '(policy|grpo)': the tokenizer .* has no pad token; set LM.pad_token"
    with pytest.raises(flowrl.FlowError, match=no_pad):
        make_engine(folder, tmp_path, 1).learn()
    assert flowrl_actor_names() == []
