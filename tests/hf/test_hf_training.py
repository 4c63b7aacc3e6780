"""Training through the Hugging Face models: GRPO on two gloo ranks takes the steps one rank
takes on the whole batch, and an engine of HF models resumed from a checkpoint continues the
uninterrupted run exactly."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import hf_ranks
import hf_tiny
import pytest
import torch
import torch.multiprocessing as mp

import flowrl
from flowrl import hf
from flowrl._core.training.state_format import CheckpointFolders, decode_state

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

pytest.importorskip("transformers")

GROUP, GROUPS, STEPS = 4, 4, 3
ATOL, RTOL = 1e-6, 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Models this small gain nothing from intra-op threads, and on a busy machine every op
    waits for a descheduled thread (100x slower): one thread, as in the spawned ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_samples(trainer: hf.GRPOTrainer) -> hf_ranks.Samples:
    """``GROUPS`` prompts with ``GROUP`` responses each, of varied lengths; the rollout's
    log-probs are the model's own less a little noise, so the first step is already off-policy."""
    g = torch.Generator().manual_seed(0)

    def ids(low: int, high: int) -> torch.Tensor:
        return torch.randint(5, 300, (int(torch.randint(low, high, (1,), generator=g)),), generator=g)

    samples: list[dict[str, Any]] = []
    for prompt_index in range(GROUPS):
        prompt = ids(3, 9)
        for _ in range(GROUP):
            score = float(torch.randint(0, 4, (1,), generator=g))
            samples.append(
                {"prompt_ids": prompt, "response_ids": ids(2, 13), "score": score, "prompt_index": prompt_index}
            )
    with torch.no_grad():
        own, _ = trainer.logprobs(flowrl.Batch.from_samples(list(range(len(samples))), samples))
    for row, sample in zip(own, samples, strict=True):
        n = len(sample["response_ids"])
        sample["logprobs"] = row[:n] - 0.05 * torch.rand(n, generator=g)
    return list(range(len(samples))), samples


# Adam's eps is raised from 1e-8: a weight whose gradient is a near-cancelling sum (the pad
# token's row of the tied embedding, ~1e-10) would otherwise be stepped by ~lr * g / eps, and the
# rounding of g that differs between one and two ranks would move it by more than the tolerance.
COMMON = {"lr": 1e-3, "eps": 1e-6, "global_batch": GROUP * GROUPS}
ROWS = {"aggregation": "token-mean", "micro_batch_tokens": 0, "micro_batch": 3}
TOKENS = {"aggregation": "seq-mean-token-mean", "micro_batch_tokens": 40, "micro_batch": 0}
CASES = {  # fsdp "never": gradients summed by Model.all_reduce_grads; "auto": FSDP2 over the two ranks
    "token-mean,3-rows": {**ROWS, **COMMON, "fsdp": "never"},
    "seq-mean-token-mean,40-tokens": {**TOKENS, **COMMON, "fsdp": "never"},
    "token-mean,3-rows,fsdp": {**ROWS, **COMMON, "fsdp": "auto"},
    # three groups on rank 0, one on rank 1: rank 1 runs fewer micro-batches, and idle passes
    # keep its FSDP collectives paired with rank 0's (without them the ranks would wait forever)
    "token-mean,3-rows,fsdp,uneven": {**ROWS, **COMMON, "fsdp": "auto", "rank1_groups": [3]},
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The samples, and what two spawned gloo ranks trained from them, per case (one spawn for
    all the cases: a process's start is most of the time)."""
    folder = tmp_path_factory.mktemp("ranks")
    tokenizer = hf_tiny.make_tokenizer(folder / "tokenizer")
    ids, samples = make_samples(hf_ranks.make_trainer(tokenizer, next(iter(CASES.values()))))

    # rank r trains on the groups g with g % 2 == r (or rank 1 on a case's rank1_groups): whole
    # groups, in the batch's order
    def split(case: dict[str, Any]) -> list[hf_ranks.Samples]:
        ones = case.get("rank1_groups", [g for g in range(GROUPS) if g % 2])
        out = []
        for r in range(2):
            rows = [i for i in ids if (samples[i]["prompt_index"] in ones) == (r == 1)]
            out.append((rows, [samples[i] for i in rows]))
        return out

    cases = [{**case, "shards": split(case)} for case in CASES.values()]
    shards = cases[0]["shards"]
    job = {"tokenizer": tokenizer, "cases": cases, "shards": shards, "steps": STEPS}
    torch.save(job, folder / "job.pt")
    mp.start_processes(hf_ranks.rank_main, args=(2, str(folder)), nprocs=2, join=True, start_method="spawn")
    per_rank = [torch.load(folder / f"rank{r}.pt") for r in range(2)]
    results = {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(CASES)}
    return {"tokenizer": tokenizer, "samples": (ids, samples), "shards": shards, "results": results}


@pytest.mark.parametrize("name", list(CASES))
def test_grpo_on_two_gloo_ranks_takes_the_steps_of_one_rank(two_ranks: dict[str, Any], name: str) -> None:
    case = CASES[name]
    one = hf_ranks.make_trainer(two_ranks["tokenizer"], case)  # world_size 1, no process group
    initial = {k: torch.as_tensor(v).detach().clone() for k, v in one.get_weights().items()}
    for shard in two_ranks["shards"]:  # each rank cuts its shard into several micro-batches
        assert len(list(one.micro_batch_rows(flowrl.Batch.from_samples(*shard)))) > 1
    expected = hf_ranks.train(one, two_ranks["samples"], STEPS)

    moved = max(float((expected["weights"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1000 * ATOL  # the steps changed the weights: equal weights below are no accident
    for r, got in enumerate(two_ranks["results"][name]):
        for step, (mine, want) in enumerate(zip(got["metrics"], expected["metrics"], strict=True)):
            # the norm of the gradient summed over the ranks is the one rank's, step by step
            assert mine["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL), (r, step)
            assert mine["lr"] == want["lr"]
        if r > 0 and case["fsdp"] == "auto" and not got["weights"]:
            continue  # the whole weights of a sharded model go to rank 0 only
        assert got["weights"].keys() == expected["weights"].keys(), r
        for key, value in expected["weights"].items():
            torch.testing.assert_close(
                got["weights"][key], value, atol=ATOL, rtol=RTOL, msg=lambda m, r=r, k=key: f"rank {r}, {k}: {m}"
            )


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case["fsdp"] == "auto"])
def test_a_sharded_trainers_broadcast_snapshot_gathers_its_weights_tensor_by_tensor(
    two_ranks: dict[str, Any], name: str
) -> None:
    rank0, rank1 = two_ranks["results"][name]
    assert rank1["sent"] is None  # the other rank gathered along and keeps nothing
    whole = rank0["weights"]  # gathered at once, into host memory
    assert rank0["sent"].keys() == whole.keys()
    for key, value in whole.items():
        assert rank0["sent"][key].dtype == value.dtype and rank0["sent"][key].shape == value.shape, key
        assert torch.equal(rank0["sent"][key], value), key


def assert_same_state(got: Any, want: Any, where: str) -> None:
    """Nested checkpoint states equal: the same keys, tensors within tolerance."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_same_state(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):  # a checkpoint file keeps tuples (Adam's betas) as lists
        assert isinstance(got, (list, tuple)) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_state(a, b, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(torch.as_tensor(got), want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: {m}")
    else:
        assert got == want, where


@pytest.mark.parametrize("name", [n for n, case in CASES.items() if case["fsdp"] == "auto"])
def test_a_sharded_trainers_checkpoint_is_the_one_rank_format_and_restores_there(
    two_ranks: dict[str, Any], name: str
) -> None:
    one = hf_ranks.make_trainer(two_ranks["tokenizer"], CASES[name])
    want = hf_ranks.train(one, two_ranks["samples"], STEPS)["state"]
    sharded = two_ranks["results"][name][0]["state"]
    assert_same_state(sharded, want, "state")  # optimizer state keyed by name, whole, in both

    again = hf_ranks.make_trainer(two_ranks["tokenizer"], CASES[name])  # a resume on one rank
    again.restore_state(sharded)
    assert_same_state(again.checkpoint_state(), want, "restored")
    step = flowrl.Batch.from_samples(*two_ranks["samples"])
    assert again.train_step(step, 0)["grad_norm"] == pytest.approx(one.train_step(step, 0)["grad_norm"], rel=RTOL)


# ---- checkpoint and exact resume of an engine of HF models ----
PROMPTS = ["what is one", "the answer", "seven plus", "nine minus two", "yes or no", "three equals"]


def make_engine(tokenizer: str, records: list[list[Any]], **checkpoint: Any) -> flowrl.Engine:
    """A sampling HF policy, a rule reward that counts the letter "e" of each response, a GRPO
    trainer synced to the policy; ``records`` gets each episode's (ids, responses, scores).
    ``checkpoint``: more ``RunConfig.checkpoint`` keys (its ``dir``, a ``resume``)."""
    lm = {"config": hf_tiny.llama(), "tokenizer": tokenizer}
    # a random model seldom samples its eos: stopping on 40 of the ~300 tokens varies the lengths
    sampling = {"max_new_tokens": 8, "stop_token_ids": tuple(range(5, 45))}
    policy = hf.HFPolicy("policy", {"batch_size": 8}, lm=lm, sampling=sampling)
    reward = hf.RuleReward("reward", {"batch_size": 8}, fn=hf_ranks.e_count)
    trainer = hf.GRPOTrainer("grpo", lm=lm, optim={"lr": 1e-2})
    cfg = {
        "sample_per_episode": 16,
        "num_episode": 3,
        "num_samples_per_prompt": GROUP,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 4,
        "shuffle": True,
        "seed": 1,
        "checkpoint": {"every": 1, "keep": 0, **checkpoint},
        "progress": "off",
        "pipeline": {"backend": "inprocess"},
    }
    engine = flowrl.Engine(
        rollout=lambda p: reward.forward_step(policy.forward_step(p)),
        train=[trainer],
        sync=[(trainer, policy)],
        config=cfg,
    )
    engine.set_dataset([{"prompt": p} for p in PROMPTS])

    def relay(episodes: list[flowrl.EpisodeBuffer]) -> list[flowrl.Sample]:
        last = episodes[-1].buffer
        records.append([(s.id, s["response_ids"].tolist(), float(s["score"])) for s in last])
        return list(last)

    engine.set_relay_sample_fn(relay)
    return engine


def trainer_state(folder: Path) -> dict[str, Any]:
    """The trainer's state in a checkpoint folder (weights, optimiser, schedule)."""
    return decode_state(CheckpointFolders.read(folder, "grpo.model.msgpack"))


def max_change(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(float((torch.as_tensor(a[k]) - torch.as_tensor(b[k])).abs().max()) for k in a)


def assert_same_metrics(got: dict[str, float], want: dict[str, float], where: object) -> None:
    assert got.keys() == want.keys(), where
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-6), (where, key)


def test_an_engine_of_hf_models_resumes_exactly_from_a_checkpoint(tmp_path: Path) -> None:
    # In process the policy samples from the generators a checkpoint keeps (the trainer rank's,
    # in the same process), so even a sampling run continues exactly.
    tokenizer = hf_tiny.make_tokenizer(tmp_path / "tokenizer")
    whole_records: list[list[Any]] = []
    whole = make_engine(tokenizer, whole_records, dir=str(tmp_path / "whole"))
    whole_stats = whole.learn()
    saved = CheckpointFolders(tmp_path / "whole")
    resumed_records: list[list[Any]] = []
    resumed = make_engine(tokenizer, resumed_records, dir=str(tmp_path / "resumed"), resume=str(saved.path(1)))
    resumed_stats = resumed.learn()

    # the run learned: the weights moved after episode 1, so the rollouts after it depend on
    # restoring the weights, the optimiser's state, the generators and the sampler exactly
    assert max_change(trainer_state(saved.path(3))["module"], trainer_state(saved.path(1))["module"]) > 1e-3
    assert len(whole_records) == 3
    assert resumed_records == whole_records[1:]  # the same prompts, responses and scores
    got, want = resumed.train_results, whole.train_results[1:]
    assert len(got) == len(want) == 2
    for episode, (mine, theirs) in enumerate(zip(got, want, strict=True), start=1):
        for step, (a, b) in enumerate(zip(mine["grpo"], theirs["grpo"], strict=True)):
            clean = [{k: v for k, v in rank[0].items() if not k.startswith("_")} for rank in (a, b)]
            assert_same_metrics(*clean, (episode, step))
    assert [e.episode for e in resumed_stats.episodes] == [0, 1, 2]  # episode 0's from the checkpoint
    for mine, theirs in zip(resumed_stats.episodes, whole_stats.episodes, strict=True):
        assert_same_metrics(mine.metrics["grpo"], theirs.metrics["grpo"], mine.episode)
    final = trainer_state(CheckpointFolders(tmp_path / "resumed").path(3))["module"]
    for key, value in trainer_state(saved.path(3))["module"].items():
        torch.testing.assert_close(torch.as_tensor(final[key]), torch.as_tensor(value), atol=1e-6, rtol=0)
