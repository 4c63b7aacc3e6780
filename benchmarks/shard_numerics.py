"""Does a sample's output depend on how many samples share its forward pass? (issue 24;
docs/reproducibility.md): a small MLP over 37 samples in one batch, then in shards of 1 to 13,
on the CPU; prints, per shard size, whether the outputs are bitwise equal and the largest gap.

    python benchmarks/shard_numerics.py
"""

from __future__ import annotations

import torch


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(16, 64), torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16)
    )
    x = torch.randint(0, 16, (37, 5))
    with torch.no_grad():
        whole = model(x)
        print("| shard size | bitwise equal | largest gap |")
        print("| --- | --- | --- |")
        for size in (1, 2, 3, 4, 5, 7, 8, 13):
            parts = torch.cat([model(x[i : i + size]) for i in range(0, len(x), size)])
            print(f"| {size} | {torch.equal(parts, whole)} | {(parts - whole).abs().max().item():.3g} |")


if __name__ == "__main__":
    main()
