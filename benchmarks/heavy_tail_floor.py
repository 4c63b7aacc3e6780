"""How close to the bound can any length memory bring heavy-tail-epochs? (issue 22; benchmarks.md)

On the simulator (the same scheduler and splitter as the runtime, a free runtime), epochs 2
and 3 of the load test's ``heavy-tail-epochs`` scenario, and of the same workload drawn with
other seeds, scheduled with four kinds of cost estimates:

- memory: what flowrl's ``LengthMemory`` predicts from the epochs before (the runtime's case);
- memory, geometric: the same from the mean of the log lengths (robust to one long sample);
- prompt: each prompt's true expected length, the best any per-prompt memory could know;
- truth: each sample's own length this epoch (an oracle no scheduler has).

Each cell is makespan / strict lower bound.

    python benchmarks/heavy_tail_floor.py          # a few seconds
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np

from flowrl._sim.epochs import prompt_keys
from flowrl._sim.simulate import Workload, simulate, tails
from flowrl._tools.scenarios import scenarios

if TYPE_CHECKING:
    from collections.abc import Callable

SEEDS = [22, 1, 2, 3, 4, 5]  # 22 is the load test's


def ratios(w: Workload) -> dict[str, list[float]]:
    keys = np.array(prompt_keys(w))
    first = w.stages[0].name
    prompt = tails(msgspec.structs.replace(w, epoch_noise=0.0))[first]
    seen: list[np.ndarray] = []
    out: dict[str, list[float]] = {"memory": [], "memory, geometric": [], "prompt": [], "truth": []}
    for epoch in range(3):
        we = msgspec.structs.replace(w, epoch=epoch)
        truth = tails(we)[first]
        if seen:
            past = np.array(seen)  # epochs x samples

            def per_prompt(reduce: Callable[[np.ndarray], float], past: np.ndarray = past) -> np.ndarray:
                return np.array([reduce(past[:, keys == k]) for k in keys])

            costs = {
                "memory": per_prompt(np.mean),
                "memory, geometric": per_prompt(lambda a: float(np.exp(np.log(a).mean()))),
                "prompt": prompt,
                "truth": truth,
            }
            for name, c in costs.items():
                out[name].append(simulate(we, c).ratio)
        seen.append(truth)
    return out


def main() -> None:
    base = scenarios()["heavy-tail-epochs"]
    print("| seed | memory e2, e3 | memory, geometric | prompt | truth |")
    print("| --- | --- | --- | --- | --- |")
    for seed in SEEDS:
        r = ratios(msgspec.structs.replace(base, seed=seed))
        cells = [", ".join(f"{x:.3f}" for x in r[k]) for k in ("memory", "memory, geometric", "prompt", "truth")]
        print(f"| {seed} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
