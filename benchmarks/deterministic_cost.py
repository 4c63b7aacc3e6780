"""What deterministic mode costs (issue 24; docs/reproducibility.md): wall time with
``deterministic`` False and True, alternating, the median of each and their ratio.

1. ``examples/ppo_tiny.py``'s engine in process (its six tiny models), and whether the two
   modes give the same reward curve;
2. a plain pipeline: a generator stage (4 replicas x shards of 4) whose samples take a
   heavy-tailed time each (Pareto 1.5, fixed per sample id; a call lasts their max: a batched
   decode, or their sum: one after another), then a small torch MLP scorer (2 replicas x
   shards of 8 at 0.5 ms a sample, or of 16 at 2 ms: as busy as the generator). In
   deterministic mode shards are fixed blocks (no shrinking at the end of a run) and the
   scorer waits for whole blocks of generated samples. It also says whether the scores are
   bitwise equal with another layout (1 generator x 3, 3 scorers x 5) in each mode.

    python benchmarks/deterministic_cost.py            # about 1 min on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import ppo_tiny  # noqa: E402

import flowrl  # noqa: E402


def engine_run(episodes: int, deterministic: bool) -> tuple[float, list[float]]:
    engine = ppo_tiny.make_engine(episodes, "inprocess", 1, seed=0, deterministic=deterministic, progress="off")
    start = time.perf_counter()
    curve = ppo_tiny.reward_curve(engine.learn())
    return time.perf_counter() - start, curve


def step_time(sid: int) -> float:
    """A sample's generation time: heavy-tailed, fixed by its id (the same work in both modes)."""
    draw = np.random.default_rng(sid).pareto(1.5)
    return min(0.1, 0.002 * (1.0 + draw))


class Generator(flowrl.Model):
    def __init__(self, name: str, config: dict[str, Any], combine: str) -> None:
        super().__init__(name, config)
        self.combine = combine

    @flowrl.step
    def generate(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        times = [step_time(int(i)) for i in batch.ids]
        # "max": a batched decode lasts as long as its longest sample; "sum": samples one after another
        time.sleep(max(times) if self.combine == "max" else sum(times))
        return {"tokens": [[(int(i) * 7 + k) % 16 for k in range(5)] for i in batch.ids]}


class Scorer(flowrl.Model):
    def __init__(self, name: str, config: dict[str, Any], per_sample_s: float) -> None:
        super().__init__(name, config)
        self.per_sample_s = per_sample_s

    def setup(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(16, 64), torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16)
        )

    @flowrl.step
    def score(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        with torch.no_grad():
            out = self.net(torch.tensor(batch["tokens"]))
        time.sleep(self.per_sample_s * len(batch))
        return {"score": out.sum(dim=(1, 2)).tolist()}


def pipeline_run(
    items: int, deterministic: bool, layout: tuple[int, int, int, int], combine: str, score_s: float
) -> tuple[float, list[float]]:
    gens, gen_batch, scorers, score_batch = layout
    cpu = {"cpus_per_replica": 0.25}
    gen = Generator("gen", {"num_replicas": gens, "batch_size": gen_batch, **cpu}, combine)
    scorer = Scorer("scorer", {"num_replicas": scorers, "batch_size": score_batch, **cpu}, score_s)
    config = {"backend": "inprocess", "inprocess_threads": True, "deterministic": deterministic, "progress": "off"}
    with flowrl.Pipeline(lambda x: scorer.score(gen.generate(x)), config) as pipe:
        pipe.run([{"p": i} for i in range(8)])  # warm: the first calls
        start = time.perf_counter()
        out = pipe.run([{"p": i} for i in range(items)])
        took = time.perf_counter() - start
    return took, [s["score"] for s in out]


def reset() -> None:
    # in process, deterministic mode turns torch's flag on for the whole process: off again
    # before a run without it
    torch.use_deterministic_algorithms(False)


def table(title: str, times: dict[bool, list[float]]) -> None:
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(f"\n{title}")
    print("| deterministic | runs (s) | median (s) |")
    print("| --- | --- | --- |")
    for mode, median in ((False, off), (True, on)):
        print(f"| {mode} | {', '.join(f'{t:.2f}' for t in times[mode])} | {median:.2f} |")
    print(f"ratio (True / False): {on / off:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=10)
    p.add_argument("--items", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    engine_run(1, False)  # warm: imports and first calls are not counted in either mode
    times: dict[bool, list[float]] = {False: [], True: []}
    curves: dict[bool, list[list[float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for mode in (False, True):
            reset()
            took, curve = engine_run(args.episodes, mode)
            times[mode].append(took)
            curves[mode].append(curve)
    reset()
    table(f"ppo_tiny, {args.episodes} episodes, in process", times)
    print(f"reward curves: every run of a mode the same: {all(c == curves[m][0] for m in curves for c in curves[m])}")
    print(f"reward curves of the two modes equal: {curves[False][0] == curves[True][0]}")
    print(f"last 3 episodes: False {sum(curves[False][0][-3:]) / 3:.4f}, True {sum(curves[True][0][-3:]) / 3:.4f}")

    other = (1, 3, 3, 5)
    # (generator call, scorer seconds per sample, scorer shard): the scorer fast, then as busy as the generator
    for combine, score_s, score_batch in (("max", 0.0005, 8), ("sum", 0.0005, 8), ("max", 0.002, 16)):
        layout = (4, 4, 2, score_batch)
        times = {False: [], True: []}
        scores: dict[bool, list[float]] = {}
        for _ in range(args.repeats):
            for mode in (False, True):
                reset()
                took, scores[mode] = pipeline_run(args.items, mode, layout, combine, score_s)
                times[mode].append(took)
        shape = f"generator 4 x 4 (a call: {combine} of its samples), scorer 2 x {score_batch}"
        shape += f" ({score_s * 1e3:g} ms a sample)"
        table(f"pipeline: {args.items} samples, {shape}", times)
        for mode in (False, True):
            reset()
            _, again = pipeline_run(args.items, mode, other, combine, score_s)
            print(f"deterministic={mode}: scores bitwise equal with layout 1 x 3, 3 x 5: {again == scores[mode]}")
    reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
