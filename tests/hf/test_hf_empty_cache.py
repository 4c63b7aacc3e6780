"""``Train.empty_cache``: a trainer hands its allocator's unused GPU memory back after each step
(for models colocated on the same GPU); the field is checked, and a step with it on trains."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import hf_ranks
import hf_tiny
import pytest
import torch

import flowrl
from flowrl import hf

if TYPE_CHECKING:
    from pathlib import Path

pytest.importorskip("transformers")


def test_empty_cache_is_off_by_default_and_takes_only_a_bool(tmp_path: Path) -> None:
    assert hf.Train().empty_cache is False
    assert hf.Train(empty_cache=True).empty_cache is True
    for bad in ("yes", 1, None):
        with pytest.raises(flowrl.ConfigError, match=r"Train\.empty_cache=.*Expected `bool`"):
            hf.Train(empty_cache=bad)  # type: ignore[arg-type]
    lm = {"config": hf_tiny.llama(), "tokenizer": str(tmp_path)}  # a folder; not read before the check
    with pytest.raises(flowrl.ConfigError, match=r"model 'grpo' train: Expected `bool`.*\$\.empty_cache"):
        hf.GRPOTrainer("grpo", lm=lm, train={"empty_cache": "on"})


def trainer(tokenizer: str, empty_cache: bool, gpu: bool = False, wide: bool = False) -> hf.GRPOTrainer:
    # wide: ~33M parameters, so that the optimizer's temporaries should leave tens of MiB
    # cached after a step (a tiny model's step leaves only the allocator's 2 MiB segments)
    config = hf_tiny.llama(hidden_size=1024, intermediate_size=4096) if wide else hf_tiny.llama()
    out = hf.GRPOTrainer(
        "grpo",
        lm=hf.LM(config=config, tokenizer=tokenizer),
        optim={"lr": 1e-2},
        train={"micro_batch_tokens": 24, "empty_cache": empty_cache},
    )
    out.rank, out.world_size, out.replica_id = 0, 1, 0
    out.global_batch_size, out.micro_batch_size = 8, 0
    out.gpu_ids = [0] if gpu else []  # as the runtime sets them: the device is CUDA with GPU ids
    out.setup()
    return out


def samples() -> hf_ranks.Samples:
    """Two prompts with four responses each, scored differently, the rollout's log-probs 0."""
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for prompt_index in range(2):
        prompt = torch.randint(5, 300, (5,), generator=g)
        for k in range(4):
            response = torch.randint(5, 300, (3 + k,), generator=g)
            rows.append(
                {
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "logprobs": torch.full((len(response),), -5.0),
                    "score": float(k),
                    "prompt_index": prompt_index,
                }
            )
    return list(range(len(rows))), rows


def test_a_step_with_empty_cache_trains_as_one_without_on_the_cpu(tmp_path: Path) -> None:
    tokenizer = hf_tiny.make_tokenizer(tmp_path / "tokenizer")
    released, kept = trainer(tokenizer, True), trainer(tokenizer, False)
    before = {k: torch.as_tensor(v).clone() for k, v in released.get_weights().items()}
    ran = [hf_ranks.train(t, samples(), steps=2) for t in (released, kept)]
    assert len(list(released.micro_batch_rows(flowrl.Batch.from_samples(*samples())))) > 1
    moved = max(float((ran[0]["weights"][k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4  # the steps trained
    for key, value in ran[1]["weights"].items():  # releasing nothing on a CPU changes nothing
        assert torch.equal(ran[0]["weights"][key], value), key
    assert [m["loss"] for m in ran[0]["metrics"]] == [m["loss"] for m in ran[1]["metrics"]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_with_empty_cache_leaves_less_reserved_on_a_gpu(tmp_path: Path) -> None:
    tokenizer = hf_tiny.make_tokenizer(tmp_path / "tokenizer")
    cached = {}
    for on in (False, True):
        t = trainer(tokenizer, on, gpu=True, wide=True)
        assert t.device.type == "cuda"
        t.train_step(flowrl.Batch.from_samples(*samples()), 0)
        # right after the step: hf_ranks.train's weight copies, freed later, would refill the cache
        cached[on] = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()  # reserved, unused
        del t
        torch.cuda.empty_cache()
    mib = 1 << 20
    assert cached[False] > 32 * mib  # the step left a cache to release (else this test shows nothing)
    assert cached[True] < cached[False] / 4, {k: v / mib for k, v in cached.items()}
