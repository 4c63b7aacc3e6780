"""flowrl.hf on Ray: two policy replicas, a GRPO trainer sharded by FSDP2 over two gloo ranks,
the weight sync by host, checkpoints gathered on every rank and a resume; a replicated GRPO
trainer whose killed rank is rebuilt from its peer; and a bad tokenizer that fails the engine
by name, leaving no actor."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

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


class DyingGRPO(hf.GRPOTrainer):
    """Rank 1's process exits at the start of its second train step, once (``marker``)."""

    def __init__(self, *args: Any, marker: str | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.marker = marker

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, float]:
        self.calls = getattr(self, "calls", 0) + 1
        if self.marker and self.rank == 1 and self.calls == 2:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
                os._exit(1)
            except FileExistsError:
                pass
        return super().train_step(batch, iteration)


@pytest.mark.slow  # two runs of a tiny Llama on Ray
def test_a_replicated_grpo_trainer_whose_rank_dies_is_rebuilt_from_its_peer(ray_cluster, tmp_path: Path) -> None:
    """Two gloo ranks without FSDP (``Train.fsdp="never"``): the survivor's model, AdamW and
    schedule state go to new ranks, the broken step runs again, and the run's metrics and
    synced weights are the calm run's, bit for bit (deterministic mode), with no checkpoint."""
    tokenizer = hf_tiny.make_tokenizer(tmp_path / "tok")

    def run(marker: str | None) -> tuple[list[dict[str, float]], flowrl.EngineStats]:
        lm = {"config": hf_tiny.llama(), "tokenizer": tokenizer}
        sampling = {"max_new_tokens": 6, "stop_token_ids": tuple(range(5, 45))}
        policy = hf.HFPolicy("policy", {"num_replicas": 2, "batch_size": 4, **CPU}, lm=lm, sampling=sampling)
        reward = hf.RuleReward("reward", {"batch_size": 8, **CPU}, fn=hf_ranks.e_count)
        ranks = {"num_replicas": 2, **CPU}
        trainer = DyingGRPO("grpo", ranks, lm=lm, optim={"lr": 3e-2}, train={"fsdp": "never"}, marker=marker)
        config = flowrl.RunConfig(
            sample_per_episode=16,
            num_samples_per_prompt=4,
            num_episode=3,
            train_global_batch_size=8,  # two steps an episode: the death lands mid-episode
            reproducibility={"deterministic": True},
            progress="off",
        )
        stats = hf_ranks.grpo_engine(policy, reward, trainer, config).learn()
        return [e.metrics["grpo"] for e in stats.episodes], stats

    calm, _ = run(None)
    chaos, stats = run(str(tmp_path / "died"))
    assert (tmp_path / "died").exists() and flowrl_actor_names() == []
    assert chaos == calm
    ((rebuilt,),) = [stats.rebuilds]
    assert (rebuilt.rank, rebuilt.source, rebuilt.episode, rebuilt.redone) == (1, "survivor", 0, 0)


def test_a_tokenizer_without_a_pad_token_fails_the_engine_by_name_and_leaves_no_actor(
    ray_cluster, tmp_path: Path
) -> None:
    folder = hf_tiny.make_tokenizer(tmp_path / "nopad", pad=False)
    # the policy and the trainer load the same tokenizer: whichever fails first names itself
    no_pad = r"model '(policy|grpo)': the tokenizer .* has no pad token; set LM.pad_token"
    with pytest.raises(flowrl.FlowError, match=no_pad):
        make_engine(folder, tmp_path, 1).learn()
    assert flowrl_actor_names() == []
