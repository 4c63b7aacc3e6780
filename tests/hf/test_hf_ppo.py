"""PPO through the Hugging Face models in an RLHFEngine: a sampling policy, a frozen reference,
a value model and a rule reward in the rollout; PPOTrainer and ValueTrainer train, and both
sync their weights to the rollout's models after every episode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import hf_ranks
import hf_tiny
import pytest
import torch

import flowrl
from flowrl import hf
from flowrl._core.training.state_format import CheckpointFolders, decode_state

if TYPE_CHECKING:
    from pathlib import Path

pytest.importorskip("transformers")

PROMPTS = ["what is one", "the answer", "seven plus", "nine minus two", "yes or no", "three equals"]
EPISODES = 3


def make_engine(tokenizer: str, records: list[list[dict[str, Any]]], checkpoints: Path) -> flowrl.RLHFEngine:
    lm = {"config": hf_tiny.llama(), "tokenizer": tokenizer}
    # a random model seldom samples its eos: stopping on 40 of the ~300 tokens varies the lengths
    sampling = {"max_new_tokens": 8, "stop_token_ids": tuple(range(5, 45))}
    ppo = {"kl_coef": 0.05, "value_clip": 0.2}
    engine = flowrl.RLHFEngine(
        policy=hf.HFPolicy("policy", {"batch_size": 8}, lm=lm, sampling=sampling),
        reference=hf.HFReference("reference", {"batch_size": 8}, lm=lm),
        reward=hf.RuleReward("reward", {"batch_size": 8}, fn=hf_ranks.e_count),
        value=hf.HFValue("value", {"batch_size": 8}, lm=lm),
        ppo_policy=hf.PPOTrainer("ppo_policy", lm=lm, ppo=ppo, optim={"lr": 1e-2}),
        ppo_value=hf.ValueTrainer("ppo_value", lm=lm, ppo=ppo, optim={"lr": 1e-2}),
        config={
            "sample_per_episode": 16,
            "num_episode": EPISODES,
            "train_global_batch_size": 8,
            "train_micro_batch_size": 4,
            "seed": 2,
            "checkpoint": {"dir": str(checkpoints), "every": 1, "keep": 0},
            "progress": "off",
            "pipeline": {"backend": "inprocess"},
        },
    )
    engine.set_dataset([{"prompt": p} for p in PROMPTS])
    fields = ("prompt_ids", "response_ids", "logprobs", "ref_logprobs", "values", "score")

    def relay(episodes: list[flowrl.EpisodeBuffer]) -> list[flowrl.Sample]:
        last = episodes[-1].buffer
        records.append([{k: s[k] for k in fields} for s in last])
        return list(last)

    engine.set_relay_sample_fn(relay)
    return engine


def values_under(tokenizer: str, weights: dict[str, Any], samples: list[dict[str, Any]]) -> list[torch.Tensor]:
    """What a value model holding ``weights`` answers for ``samples``."""
    value = hf.HFValue("value", lm={"config": hf_tiny.llama(), "tokenizer": tokenizer})
    value.setup()
    value.module.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})
    batch = flowrl.Batch.from_samples(list(range(len(samples))), samples)
    return list(value.forward_step(batch, 0)["values"])


def test_ppo_on_hf_models_trains_both_models_and_syncs_each_to_the_rollout(tmp_path: Path) -> None:
    tokenizer = hf_tiny.make_tokenizer(tmp_path / "tokenizer")
    records: list[list[dict[str, Any]]] = []
    engine = make_engine(tokenizer, records, tmp_path / "ckpt")
    stats = engine.learn()
    assert len(records) == EPISODES and all(len(r) == 16 for r in records)

    # each episode's first policy step starts from the weights that sampled its rollout: the
    # ratio to the sampling log-probs is 1 there, and moves once a step has changed the weights
    # (a first batch whose scores are all 0 gives no gradient: the value head starts at zero)
    moved = 0
    for e, steps in enumerate(engine.train_results):
        first, second = (step[0] for step in steps["ppo_policy"])
        assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and first["clip_fraction"] == 0.0, e
        if first["grad_norm"] > 0:
            assert abs(second["ratio_mean"] - 1.0) > 1e-4, e
            moved += 1
    assert moved >= EPISODES - 1

    # the reference stays frozen: equal to the policy before training, apart after it
    def drift(episode: list[dict[str, Any]]) -> float:
        return max(float((torch.as_tensor(s["logprobs"]) - s["ref_logprobs"]).abs().max()) for s in episode)

    assert drift(records[0]) < 1e-4
    assert drift(records[-1]) > 1e-3

    # the value model of episode e's rollout holds what the value trainer had after episode e-1
    saved = CheckpointFolders(tmp_path / "ckpt")
    for e in range(1, EPISODES):
        trained = decode_state(saved.read(saved.path(e), "ppo_value.model.msgpack"))["module"]
        want = values_under(tokenizer, trained, records[e])
        for got, expected in zip((s["values"] for s in records[e]), want, strict=True):
            torch.testing.assert_close(torch.as_tensor(got), expected, atol=1e-5, rtol=1e-5)
    first = decode_state(saved.read(saved.path(1), "ppo_value.model.msgpack"))["module"]
    last = decode_state(saved.read(saved.path(EPISODES), "ppo_value.model.msgpack"))["module"]
    assert max(float((torch.as_tensor(first[k]) - torch.as_tensor(last[k])).abs().max()) for k in first) > 1e-4
    assert [sorted(e.metrics) for e in stats.episodes] == [["ppo_policy", "ppo_value"]] * EPISODES
