"""The GPU benchmark scripts (benchmarks/gpu) still run, checked on the CPU with their tiny
models before GPU time is spent on them."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"


@pytest.fixture
def gpt(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU))
    import gpt

    return gpt


def test_a_shard_generates_until_its_longest_response_ends_and_pads_after_each_end(gpt):
    policy = gpt.Policy("policy", {"batch_size": 4}, size=gpt.SIZES["tiny"], tokens=8)
    policy.setup()
    items = gpt.prompts(3, 8, "eos")
    lengths = [2, 5, 3]
    batch = gpt.flowrl.Batch(
        [0, 1, 2], {"prompt": torch.stack([i["prompt"] for i in items]), "length": torch.tensor(lengths)}
    )
    out = policy.forward_step(batch, 0)
    seq = out["seq"]
    assert seq.shape == (3, gpt.PROMPT + 8) and out["old_logprobs"].shape == (3, 8)
    assert torch.equal(seq[:, : gpt.PROMPT], batch["prompt"])
    for row, n in zip(seq, lengths, strict=True):
        assert torch.all(row[gpt.PROMPT + n :] == 0)  # padding after the response's end


def test_eos_lengths_have_a_long_tail_capped_at_the_token_budget(gpt):
    lengths = [p["length"] for p in gpt.prompts(512, 128, "eos")]
    assert min(lengths) >= 1 and max(lengths) == 128
    assert 20 <= sorted(lengths)[256] <= 48  # median near a quarter of the budget
    assert all(p["length"] == 128 for p in gpt.prompts(8, 128, "full"))


def test_scaled_run_reports_every_phase_and_model(gpt, tmp_path):
    out = tmp_path / "scaled.json"
    subprocess.run(
        [
            sys.executable,
            str(GPU / "scaled.py"),
            "--tiny",
            "--episodes",
            "2",
            "--samples",
            "16",
            "--tokens",
            "8",
            "--lengths",
            "eos",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    figures = json.loads(out.read_text())
    rows = set(figures["phases"])
    assert {"rollout", "train", "sync"} <= rows
    assert {f"rollout: {m}" for m in ("policy", "reference", "value", "reward")} <= rows
    assert {"train: ppo_policy", "train: ppo_value"} <= rows
    assert figures["tokens"] == sum(p["length"] for p in gpt.prompts(16, 8, "eos"))
    assert [e["episode"] for e in figures["episodes"]] == [0, 1]


@pytest.mark.slow  # a minute: a Ray cluster and two pipelines of an HF model (python -m pytest -q -m slow)
def test_partial_rollouts_write_every_response_to_its_target_with_less_padding(tmp_path):
    pytest.importorskip("transformers")
    cmd = [sys.executable, str(GPU / "hf_partial.py"), "--tiny", "--repeats", "1", "--samples", "32"]
    cmd += ["--tokens", "32", "--segment", "8", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300, cwd=GPU)
    rollouts = {r["mode"]: r for r in json.loads((tmp_path / "hf-partial.json").read_text())["rollouts"]}
    assert all(r["off_target"] == 0 for r in rollouts.values())  # segments joined at each target length
    assert rollouts["whole"]["tokens"] == rollouts["partial"]["tokens"]
    assert rollouts["partial"]["segments"] > rollouts["whole"]["segments"] == 32
    assert rollouts["partial"]["waste"] < rollouts["whole"]["waste"]  # no call decodes past 8 tokens


@pytest.mark.slow  # two minutes: two engines of six HF models on a Ray cluster (python -m pytest -q -m slow)
def test_seed_ppo_runs_both_modes_on_every_replica_with_the_staleness_each_allows(tmp_path):
    pytest.importorskip("transformers")
    cmd = [sys.executable, str(GPU / "seed_ppo.py"), "--tiny", "--episodes", "2", "--samples", "16", "--n", "2"]
    cmd += ["--tokens", "8", "--policy-batch", "8", "--scorer-batch", "4", "--scorer-replicas", "2"]
    cmd += ["--empty-cache", "on", "--gradient-checkpointing", "on"]  # the trainers' memory switches, on a CPU
    subprocess.run([*cmd, "--out", str(tmp_path)], check=True, capture_output=True, timeout=600, cwd=GPU)
    record = json.loads((tmp_path / "seed-ppo.json").read_text())
    assert set(record["modes"]) == {"sync", "async"}
    for mode, lag in (("sync", "0"), ("async", "1")):
        rec = record["modes"][mode]
        assert rec["empty_cache"] is rec["gradient_checkpointing"] is True
        assert rec["memory"] == {}  # no GPU: no nvidia-smi memory
        assert [r["episode"] for r in rec["episodes"]] == [0, 1]
        for row in rec["episodes"]:  # 16 samples in shards of 8 and 4: every replica has work
            assert [row[f"{m} replicas"] for m in ("policy", "reference", "value", "reward")] == [2, 2, 2, 2]
            assert row["ppo_policy busy"] > 0 and row["ppo_value busy"] > 0
        # episode 1 trains on samples of the weights before episode 0's step when asynchronous
        assert rec["staleness"][1] == {"policy": {lag: 16}, "value": {lag: 16}}
    assert "| sync |" in (tmp_path / "seed-ppo.md").read_text()


def test_seed_ppo_reports_a_failed_mode_with_its_error_beside_the_modes_that_ran(monkeypatch):
    """A mode that fails (out of GPU memory on one GPU) keeps its error and the GPU memory in the
    record, and the table still shows the modes that ran."""
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(GPU))
    import seed_ppo

    args = argparse.Namespace(
        samples=16, tokens=8, policy_replicas=2, policy_batch=8, scorer_replicas=2, scorer_batch=4, episodes=2
    )
    args.empty_cache, args.gradient_checkpointing = "on", "off"
    held = {"total_peak_gib": 139.6, "peak_gib": [35.7, 19.8], "polls": 3}
    record = {"command": "seed_ppo.py", "gpus": 1, "ranks": 1, "transport": "CUDA IPC", "tokens": 29}
    ran = {"episode": 1, "rollout": 2.0, "sync": 0.1, "wait": 1.0}
    ran |= {f"{m} busy": 0.5 for m in (*seed_ppo.ROLLOUT, *seed_ppo.TRAINERS)}
    ran |= {f"{m} replicas": 2 for m in seed_ppo.ROLLOUT}
    record["modes"] = {
        "sync": {"error": "StageError: CUDA out of memory\nmore", "memory": held},
        "async": {"episodes": [{"episode": 0}, ran], "window": (10.0, 13.0)},
    }
    text = seed_ppo.markdown(record, args)
    assert "sync failed: StageError: CUDA out of memory" in text and "more" not in text
    assert "| async | 3.00 | 2.00 | 0.50 |" in text and "| sync |" not in text
    assert "the processes' sum peaked at 139.6 GiB" in text
    assert "empty_cache True, gradient_checkpointing False" in text
    assert "async / sync" not in text  # no ratio without both modes' windows
