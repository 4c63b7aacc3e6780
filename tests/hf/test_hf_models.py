"""flowrl.hf's inference models on tiny random-weight Llama and Qwen2 networks and a BPE
tokenizer trained here: generation, log-probs, weight loading, and the errors for bad input."""

from __future__ import annotations

import math
from pathlib import Path

import hf_tiny
import pytest
import torch

import flowrl
from flowrl import hf
from flowrl.hf import tokens

ARCHS = {"llama": hf_tiny.llama, "qwen2": hf_tiny.qwen2}
PROMPTS = ["what is one plus two", "yes", "seven eight nine ten the answer is", "no"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return hf_tiny.make_tokenizer(tmp_path_factory.mktemp("tok"))


def lm(tokenizer: str, arch: str = "llama", seed: int = 0) -> hf.LM:
    return hf.LM(config=ARCHS[arch](), tokenizer=tokenizer, seed=seed)


def ready(model: flowrl.Model) -> flowrl.Model:
    model.setup()
    return model


def prompts(*texts: str, **fields: list[object]) -> flowrl.Batch:
    rows = [{"prompt": t, **{k: v[i] for k, v in fields.items()}} for i, t in enumerate(texts)]
    return flowrl.Batch.from_samples(list(range(len(texts))), rows)


def rollout(policy: hf.HFPolicy, batch: flowrl.Batch) -> flowrl.Batch:
    return batch.merge(flowrl.Batch(batch.ids, policy.forward_step(batch, 0)))


# ---- pure token helpers ----
@pytest.mark.parametrize(
    ("lengths", "budget", "rows", "expected"),
    [
        ([3, 3, 3, 3], 0, 2, [[0, 1], [2, 3]]),
        ([3, 3, 3], 0, 0, [[0, 1, 2]]),
        ([2, 2, 5, 1], 6, 0, [[0, 1], [2], [3]]),
        ([2, 9, 2], 4, 0, [[0], [1], [2]]),  # a row over the budget goes alone
        ([1, 1, 1, 1], 4, 0, [[0, 1, 2, 3]]),
    ],
)
def test_token_micro_batches_cut_rows_in_order_within_the_budget(
    lengths: list[int], budget: int, rows: int, expected: list[list[int]]
) -> None:
    assert tokens.token_micro_batches(lengths, budget, rows) == expected


def test_join_puts_each_response_after_its_prompt_with_masks() -> None:
    p = tokens.join([torch.tensor([5, 6]), torch.tensor([7])], [torch.tensor([1, 2]), torch.tensor([3, 4, 8])], 0)
    assert p.input_ids.tolist() == [[5, 6, 1, 2], [7, 3, 4, 8]]
    assert p.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert p.response_mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    q = tokens.join([torch.tensor([5])], [torch.tensor([1])], 9)
    assert q.input_ids.tolist() == [[5, 1]]
    left, mask = tokens.left_pad([torch.tensor([1, 2, 3]), torch.tensor([4])], 0)
    assert left.tolist() == [[1, 2, 3], [0, 0, 4]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.mark.parametrize(
    ("row", "stops", "kept", "reason"),
    [
        ([4, 5, 1, 0, 0], [1], [4, 5, 1], "stop"),
        ([4, 5, 6], [1], [4, 5, 6], "length"),
        ([2, 5, 1], [1, 2], [2], "stop"),
        ([4, 5, 6], [], [4, 5, 6], "length"),
    ],
)
def test_cut_at_stop_keeps_the_stop_token_and_says_why(
    row: list[int], stops: list[int], kept: list[int], reason: str
) -> None:
    rows, reasons = tokens.cut_at_stop(torch.tensor([row]), stops)
    assert rows[0].tolist() == kept and reasons == [reason]


def test_token_logprobs_equal_log_softmax() -> None:
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0))
    targets = torch.tensor([[1, 2, 3], [6, 0, 5]])
    for t in (1.0, 0.7):
        expected = torch.log_softmax(logits / t, -1).gather(-1, targets[..., None]).squeeze(-1)
        torch.testing.assert_close(tokens.token_logprobs(logits, targets, t), expected)


# ---- the policy and reference ----
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_policy_samples_ragged_responses_with_their_logprobs(tokenizer: str, arch: str) -> None:
    policy = ready(hf.HFPolicy("policy", lm=lm(tokenizer, arch), sampling={"max_new_tokens": 6}))
    out = policy.forward_step(prompts(*PROMPTS), 0)
    assert len(out["response_ids"]) == len(PROMPTS) == len(out["logprobs"]) == len(out["finish_reason"])
    end = policy.tokenizer.eos_token_id
    for ids, logp, reason, prompt_ids, text in zip(
        out["response_ids"], out["logprobs"], out["finish_reason"], out["prompt_ids"], out["response_text"], strict=True
    ):
        assert 1 <= len(ids) <= 6 and logp.shape == ids.shape and bool((logp <= 0).all())
        assert reason == ("stop" if ids[-1] == end else "length")
        assert end not in ids[:-1].tolist()  # cut at the first stop token
        assert prompt_ids.dtype == torch.long and text == policy.tokenizer.decode(ids, skip_special_tokens=True)
    assert out["weight_version"].tolist() == [0] * len(PROMPTS)
    rendered = policy.tokenizer.decode(out["prompt_ids"][1])
    assert rendered == "<|user|>yes<|end|><|assistant|>"  # the chat template, with the generation prompt


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_policy_logprobs_equal_a_direct_forward_pass_and_the_reference(
    tokenizer: str, arch: str, temperature: float
) -> None:
    """The log-probs recorded while sampling (KV cache, left-padded batch) are those of one
    forward pass over each prompt + response alone, and the reference computes the same."""
    sampling = {"max_new_tokens": 8, "temperature": temperature}
    policy = ready(hf.HFPolicy("policy", lm=lm(tokenizer, arch), sampling=sampling))
    batch = rollout(policy, prompts(*PROMPTS))
    for prompt, response, logp in zip(batch["prompt_ids"], batch["response_ids"], batch["logprobs"], strict=True):
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            logits = policy.module(input_ids=ids).logits[0, len(prompt) - 1 : -1] / temperature
        direct = torch.log_softmax(logits, -1).gather(-1, response[:, None]).squeeze(-1)
        torch.testing.assert_close(logp, direct, atol=2e-5, rtol=1e-4)
    reference = ready(hf.HFReference("reference", lm=lm(tokenizer, arch), temperature=temperature))
    ref = reference.forward_step(batch, 0)["ref_logprobs"]
    for a, b in zip(batch["logprobs"], ref, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_greedy_sampling_depends_only_on_the_weights(tokenizer: str) -> None:
    greedy = {"max_new_tokens": 5, "temperature": 0.0}
    a = ready(hf.HFPolicy("a", lm=lm(tokenizer), sampling=greedy)).forward_step(prompts(*PROMPTS), 0)
    b = ready(hf.HFPolicy("b", lm=lm(tokenizer), sampling=greedy)).forward_step(prompts(*reversed(PROMPTS)), 0)
    assert [r.tolist() for r in a["response_ids"]] == [r.tolist() for r in reversed(b["response_ids"])]
    other = ready(hf.HFPolicy("c", lm=lm(tokenizer, seed=1), sampling=greedy)).forward_step(prompts(*PROMPTS), 0)
    assert [r.tolist() for r in a["response_ids"]] != [r.tolist() for r in other["response_ids"]]


def test_loading_a_trainers_weights_makes_the_policys_logprobs_the_trainers(tokenizer: str) -> None:
    policy = ready(hf.HFPolicy("policy", lm=lm(tokenizer), sampling={"max_new_tokens": 6}))
    trainer = ready(hf.GRPOTrainer("trainer", lm=lm(tokenizer, seed=7)))
    batch = rollout(policy, prompts(*PROMPTS))
    with torch.no_grad():
        theirs, mask = trainer.logprobs(batch)
    ours = tokens.right_pad(batch["logprobs"])
    assert float(((theirs - ours).abs() * mask).max()) > 1e-3  # different weights so far
    policy.set_weights(trainer.get_weights())
    again = rollout(policy, prompts(*PROMPTS))
    with torch.no_grad():
        theirs, mask = trainer.logprobs(again)
    torch.testing.assert_close(theirs * mask, tokens.right_pad(again["logprobs"]), atol=2e-5, rtol=1e-4)


def test_value_model_reads_each_tokens_value_before_it(tokenizer: str) -> None:
    policy = ready(hf.HFPolicy("policy", lm=lm(tokenizer), sampling={"max_new_tokens": 4}))
    batch = rollout(policy, prompts(*PROMPTS))
    value = ready(hf.HFValue("value", lm=lm(tokenizer)))
    torch.nn.init.normal_(value.module.head.weight)
    out = value.forward_step(batch, 0)["values"]
    for prompt, response, v in zip(batch["prompt_ids"], batch["response_ids"], out, strict=True):
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            direct = value.module(ids, torch.ones_like(ids))[0, len(prompt) - 1 : -1]
        torch.testing.assert_close(v, direct, atol=2e-5, rtol=1e-4)


def test_reward_model_scores_each_sequence(tokenizer: str) -> None:
    policy = ready(hf.HFPolicy("policy", lm=lm(tokenizer), sampling={"max_new_tokens": 4}))
    batch = rollout(policy, prompts(*PROMPTS))
    scorer = ready(hf.HFRewardModel("rm", lm=lm(tokenizer)))
    score = scorer.forward_step(batch, 0)["score"]
    assert score.shape == (len(PROMPTS),) and bool(torch.isfinite(score).all())
    alone = scorer.forward_step(batch.select([2]), 0)["score"]
    torch.testing.assert_close(alone, score[2:3], atol=2e-5, rtol=1e-4)  # padding does not change a score


def exact(prompt: str, response: str, answer: str, **fields: object) -> float:
    return float(response.strip() == answer)


def broken(prompt: str, response: str, **fields: object) -> float:
    raise KeyError("answer")


def not_a_number(prompt: str, response: str, **fields: object) -> float:
    return math.nan


def test_rule_reward_runs_the_function_over_decoded_text() -> None:
    batch = prompts("a", "b", answer=["4", "5"]).merge(
        flowrl.Batch(flowrl.Batch.from_samples([0, 1], [{}, {}]).ids, {"response_text": [" 4", "6"]})
    )
    out = hf.RuleReward("reward", fn=exact).forward_step(batch, 0)
    assert out["score"].tolist() == [1.0, 0.0]
    by_name = hf.RuleReward("reward", fn=f"{__name__}:exact").forward_step(batch, 0)
    assert by_name["score"].tolist() == [1.0, 0.0]


# ---- bad input: an error naming the model and the setting ----
def test_bad_settings_fail_when_the_model_is_made(tokenizer: str, tmp_path: object) -> None:
    with pytest.raises(flowrl.ConfigError, match=r"model 'policy': LM.path='/no/such/model' is not a folder"):
        hf.HFPolicy("policy", lm={"path": "/no/such/model"})
    with pytest.raises(flowrl.ConfigError, match=r"Sampling.max_new_tokens must be > 0, got 0"):
        hf.HFPolicy("policy", lm=lm(tokenizer), sampling={"max_new_tokens": 0})
    with pytest.raises(flowrl.ConfigError, match=r"model 'policy' sampling: .*max_new_tokenz"):
        hf.HFPolicy("policy", lm=lm(tokenizer), sampling={"max_new_tokenz": 3})
    with pytest.raises(flowrl.ConfigError, match=r"give path= .* or config="):
        hf.LM(tokenizer=tokenizer)
    with pytest.raises(flowrl.ConfigError, match=r"model 'reward': fn='nowhere:fn' is not an importable"):
        hf.RuleReward("reward", fn="nowhere:fn")


def test_relative_folders_are_made_absolute_where_the_model_is_made(
    tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # replicas run in other working folders: there a relative path would not resolve
    folder = Path(tokenizer)
    monkeypatch.chdir(folder.parent)
    policy = hf.HFPolicy("policy", lm={"config": hf_tiny.llama(), "tokenizer": folder.name})
    monkeypatch.chdir(folder.root)
    assert policy.lm.tokenizer == str(folder.resolve())
    ready(policy)  # loads from anywhere now


def test_a_tokenizer_without_a_pad_token_is_named(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = hf_tiny.make_tokenizer(tmp_path_factory.mktemp("nopad"), pad=False)
    policy = hf.HFPolicy("policy", lm=hf.LM(config=hf_tiny.llama(), tokenizer=folder))
    with pytest.raises(
        flowrl.ConfigError, match=r"model 'policy': the tokenizer .* has no pad token; set LM.pad_token"
    ):
        policy.setup()
    fixed = ready(hf.HFPolicy("policy", lm=hf.LM(config=hf_tiny.llama(), tokenizer=folder, pad_token="<|end|>")))
    assert fixed.tokenizer.pad_token == "<|end|>"


def test_a_prompt_longer_than_the_context_is_named(tokenizer: str) -> None:
    policy = ready(hf.HFPolicy("policy", lm=lm(tokenizer), sampling={"max_new_tokens": 100}))
    with pytest.raises(flowrl.ConfigError, match=r"the prompt of sample 1 has \d+ tokens, more than 28"):
        policy.forward_step(prompts("yes", " ".join(hf_tiny.WORDS * 2)), 0)
    with pytest.raises(flowrl.ConfigError, match=r"max_new_tokens=200 leaves no room for a prompt"):
        ready(hf.HFPolicy("policy", lm=lm(tokenizer), sampling={"max_new_tokens": 200}))


@pytest.mark.parametrize(("fn", "message"), [(broken, "raised KeyError: 'answer' on sample 0"), (not_a_number, "nan")])
def test_a_reward_function_that_fails_is_named(fn: object, message: str) -> None:
    batch = prompts("a").merge(flowrl.Batch(prompts("a").ids, {"response_text": ["x"]}))
    with pytest.raises(ValueError, match=rf"reward 'reward': .*{fn.__name__}.*{message}"):  # type: ignore[attr-defined]
        hf.RuleReward("reward", fn=fn).forward_step(batch, 0)  # type: ignore[arg-type]


def test_a_trainer_of_another_architecture_is_refused_when_the_engine_is_built(tokenizer: str) -> None:
    policy = hf.HFPolicy("policy", lm=lm(tokenizer, "llama"))
    reward = hf.RuleReward("reward", fn=exact)
    config = flowrl.RunConfig(sample_per_episode=4, num_episode=1, num_samples_per_prompt=2)

    def flow(p: flowrl.Node) -> flowrl.Node:  # type: ignore[name-defined]
        return reward.forward_step(policy.forward_step(p))

    for trainer, message in [
        (
            hf.GRPOTrainer("trainer", lm=hf.LM(config=hf_tiny.llama(hidden_size=48), tokenizer=tokenizer)),
            "hidden_size: 48 vs 32",
        ),
        (hf.GRPOTrainer("trainer", lm=lm(tokenizer, "qwen2")), "model_type: 'qwen2' vs 'llama'"),
        (hf.ValueTrainer("trainer", lm=lm(tokenizer)), "is an HF value model"),
    ]:
        with pytest.raises(flowrl.ConfigError, match=rf"sync pair \('trainer' -> 'policy'\).*{message}"):
            flowrl.Engine(rollout=flow, train=[trainer], sync=[(trainer, policy)], config=config)
    same = hf.GRPOTrainer("trainer", lm=hf.LM(config=hf_tiny.llama(), tokenizer=tokenizer, seed=3))
    flowrl.Engine(rollout=flow, train=[same], sync=[(same, policy)], config=config)  # other weights, same network


def test_responses_of_equal_length_stacked_into_one_tensor_score_and_train_alike(tokenizer: str) -> None:
    """A shard whose responses all have one length arrives with ``response_ids`` as one 2-D
    tensor, not a list of rows: the models read it the same way."""
    g = torch.Generator().manual_seed(0)
    samples = [
        {
            "prompt_ids": torch.randint(5, 300, (4,), generator=g),
            "response_ids": torch.randint(5, 300, (3,), generator=g),
            "logprobs": -torch.rand(3, generator=g),
            "score": float(i % 2),
            "prompt_index": i // 2,
        }
        for i in range(4)
    ]
    stacked = flowrl.Batch.from_samples(list(range(4)), samples)
    listed = flowrl.Batch(stacked.ids, {k: [s[k] for s in samples] for k in samples[0]})
    assert isinstance(stacked["response_ids"], torch.Tensor) and isinstance(listed["response_ids"], list)
    reference = ready(hf.HFReference("reference", lm=lm(tokenizer)))
    for a, b in zip(
        reference.forward_step(stacked, 0)["ref_logprobs"],
        reference.forward_step(listed, 0)["ref_logprobs"],
        strict=True,
    ):
        torch.testing.assert_close(a, b)
    losses = []
    for batch in (stacked, listed):
        trainer = ready(hf.GRPOTrainer("trainer", lm=lm(tokenizer), optim={"lr": 1e-3}))
        trainer.global_batch_size = 4
        losses.append(trainer.train_step(batch, 0)["loss"])
    assert math.isfinite(losses[0]) and losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_objective_settings_that_cannot_work_are_refused(tokenizer: str) -> None:
    with pytest.raises(flowrl.ConfigError, match=r"GRPO.aggregation='seq-mean-token-sum-norm' .* set GRPO.max_tokens"):
        hf.GRPO(aggregation="seq-mean-token-sum-norm")
    hf.GRPO(aggregation="seq-mean-token-sum-norm", max_tokens=64)
    policy = hf.HFPolicy("policy", lm=lm(tokenizer), sampling={"temperature": 0.7})
    hot = hf.GRPOTrainer("trainer", lm=lm(tokenizer))
    with pytest.raises(flowrl.ConfigError, match=r"samples at temperature 0.7 .* at 1.0 \(Train.temperature\)"):
        policy.check_weights_from(hot)
    policy.check_weights_from(hf.GRPOTrainer("trainer", lm=lm(tokenizer), train={"temperature": 0.7}))


def test_a_trainer_missing_a_field_names_the_model_that_writes_it(tokenizer: str) -> None:
    samples = [
        {
            "prompt_ids": torch.tensor([5, 6]),
            "response_ids": torch.tensor([7, 8, 9]),
            "logprobs": -torch.ones(3),
            "score": float(i),
            "prompt_index": 0,
        }
        for i in range(2)
    ]
    batch = flowrl.Batch.from_samples([0, 1], samples)
    trainer = ready(hf.GRPOTrainer("trainer", lm=lm(tokenizer), grpo={"kl_coef": 0.1}))
    trainer.global_batch_size = 2
    with pytest.raises(flowrl.ConfigError, match=r"needs field 'ref_logprobs' for GRPO.kl_coef > 0;.* an HFReference"):
        trainer.train_step(batch, 0)
    ppo = ready(hf.PPOTrainer("trainer", lm=lm(tokenizer), ppo={"kl_coef": 0.0}))
    ppo.global_batch_size = 2
    with pytest.raises(flowrl.ConfigError, match=r"needs field 'values' for PPO's advantages \(GAE\);.* an HFValue"):
        ppo.train_step(batch, 0)
