"""flowrl.hf trainers on two gloo ranks step the same through the trainer runtime, whose
optimizer hook sums gradients, as by hand: gradients ``all_reduce_grads`` summed (or FSDP
reduced) are never summed again, and a sharded model's ranks are not compared."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import _rank_trainers as rt
import hf_tiny
import pytest
import torch
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from pathlib import Path

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder: Path = tmp_path_factory.mktemp("hf_hooks")
    tokenizer = hf_tiny.make_tokenizer(folder / "tokenizer")
    torch.save({"tokenizer": tokenizer, "samples": rt.hf_samples(tokenizer)}, folder / "job.pt")
    mp.start_processes(rt.hf_rank_main, args=(2, str(folder)), nprocs=2, join=True, start_method="spawn")
    return [torch.load(folder / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", list(rt.HF_CASES))
def test_an_hf_trainer_steps_the_same_through_the_runtimes_hook(ranks, name):
    for r, out in enumerate(ranks):
        (hand, hand_norms), (hooked, hooked_norms) = out[name]["by_hand"], out[name]["hooked"]
        assert hooked_norms == pytest.approx(hand_norms, rel=1e-6), r  # one sum over the ranks, not two
        assert hooked.keys() == hand.keys(), r
        for key, value in hand.items():
            torch.testing.assert_close(
                hooked[key], value, atol=1e-7, rtol=1e-6, msg=lambda m, k=key, r=r: f"rank {r}, {k}: {m}"
            )
    before, after = ranks[0][name]["checksums"]
    if name == "fsdp":  # shards differ by design: nothing to compare
        assert before is None and after is None and ranks[1][name]["checksums"] == (None, None)
    else:
        assert before != after and ranks[1][name]["checksums"] == (before, after)
