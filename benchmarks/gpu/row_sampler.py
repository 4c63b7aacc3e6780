"""What per-row sampling costs a decode step (issue 24; docs/reproducibility.md): the time of
``flowrl.hf.sampling.RowSampler`` (warpers, then Gumbel noise from one generator per row) on
logits ``[rows, vocab]``, against ``torch.multinomial`` over the softmax with one generator,
on the GPU when there is one.

    python3 benchmarks/gpu/row_sampler.py     # seconds; prints a table
"""

from __future__ import annotations

import time

import torch

from flowrl.hf.config import Sampling
from flowrl.hf.sampling import RowSampler


def timed(fn, device: str, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device: {torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}")
    print("| rows | vocab | per-row Gumbel ms | multinomial ms | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for rows, vocab in [(8, 49152), (32, 49152), (128, 49152), (32, 151936)]:
        logits = torch.randn(rows, vocab, device=device)
        ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        gens = [torch.Generator(device).manual_seed(i) for i in range(rows)]
        one = torch.Generator(device).manual_seed(0)
        sampler = RowSampler(Sampling(temperature=1.0), gens)
        row = timed(lambda: sampler(ids, logits).argmax(-1), device)  # noqa: B023
        flat = timed(lambda: torch.multinomial(torch.softmax(logits, -1), 1, generator=one), device)  # noqa: B023
        print(f"| {rows} | {vocab} | {row * 1e3:.3f} | {flat * 1e3:.3f} | {row / flat:.1f} |")


if __name__ == "__main__":
    main()
