"""ChatLearn issue #209, run by flowrl: every replica of every downstream stage works.

A policy with 2 replicas emits batches of 4; reference, value and reward have 8 replicas
each with batch size 2; reward reads the outputs of policy, reference and value. ChatLearn
hands each 4-sample batch whole to one downstream replica, so only 4 of 8 replicas work and
each counts 16 consumed samples instead of 32. flowrl cuts shards on demand instead.

    python examples/fanout_utilization.py            # Ray backend (starts a local cluster)
    python examples/fanout_utilization.py --inprocess  # one process, for breakpoints
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np

import flowrl

SAMPLES_PER_ROUND, ROUNDS = 16, 2


class Policy(flowrl.Model):
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(0.02)  # stands in for generation on a GPU
        return {"policy_out": batch["query"] * 1.0, "policy_replica": [self.replica_id] * len(batch)}


class Scorer(flowrl.Model):
    """reference / value: out = factor * policy_out; remembers which replica did each sample."""

    def __init__(self, name: str, config: dict[str, Any], factor: float) -> None:
        super().__init__(name, config)
        self.factor = factor

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(0.01)
        return {
            f"{self.name}_out": batch["policy_out"] * self.factor,
            f"{self.name}_replica": [self.replica_id] * len(batch),
        }


class Reward(flowrl.Model):
    @flowrl.step(reads=["policy_out", "reference_out", "value_out"], writes=["reward", "reward_replica"])
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(0.01)
        score = batch["reference_out"] + batch["policy_out"] + batch["value_out"]
        return {"reward": score, "reward_replica": [self.replica_id] * len(batch)}


def build_flow():
    wide = {"num_replicas": 8, "batch_size": 2, "cpus_per_replica": 0.25}
    policy = Policy("policy", {"num_replicas": 2, "batch_size": 4, "cpus_per_replica": 0.25})
    reference = Scorer("reference", wide, factor=2.0)
    value = Scorer("value", wide, factor=3.0)
    reward = Reward("reward", wide)

    def rollout(prompts):
        out = policy.forward_step(prompts)
        ref = reference.forward_step(out)
        val = value.forward_step(out)
        return reward.forward_step(out, ref, val)

    return rollout


def report(stats: flowrl.PipelineStats) -> None:
    print(f"\n{'stage':<24}{'samples':>8}{'calls':>7}{'max shard':>10}   samples per replica")
    for name, st in stats.stages.items():
        per = " ".join(f"{r.samples:>2}" for r in st.replicas)
        print(f"{name:<24}{st.samples:>8}{st.calls:>7}{st.max_shard:>10}   {per}")
    print(f"\nactive {stats.active_s:.2f}s; replica busy fraction: ", end="")
    print(
        ", ".join(
            f"{n.split('.')[0]} {st.busy_s / (stats.active_s * len(st.replicas)):.0%}" for n, st in stats.stages.items()
        )
    )


def check(samples: list[flowrl.Sample], stats: flowrl.PipelineStats) -> list[str]:
    problems = []
    if [s.id for s in samples] != list(range(SAMPLES_PER_ROUND * ROUNDS)):
        problems.append("outputs are not every sample id in order")
    problems.extend(  # joined by sample id: (2 + 1 + 3) * query
        f"sample {s.id}: reward {s['reward']} != 6 * query"
        for s in samples
        if not np.allclose(s["reward"], 6.0 * s["query"])
    )
    for stage in ("reference", "value", "reward"):
        st = stats[f"{stage}.forward_step"]
        if st.samples != SAMPLES_PER_ROUND * ROUNDS or st.max_shard > 2:
            problems.append(f"{stage}: {st.samples} samples, max shard {st.max_shard}")
        for r in range(ROUNDS):
            used = {s[f"{stage}_replica"] for s in samples[r * SAMPLES_PER_ROUND : (r + 1) * SAMPLES_PER_ROUND]}
            if len(used) != 8:
                problems.append(f"{stage}, round {r}: only replicas {sorted(used)} worked")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inprocess", action="store_true", help="run in one process (debugging)")
    args = parser.parse_args(argv)
    config = flowrl.PipelineConfig(backend="inprocess", inprocess_threads=True) if args.inprocess else None
    samples: list[flowrl.Sample] = []
    with flowrl.Pipeline(build_flow(), config) as pipe:
        for r in range(ROUNDS):
            first = r * SAMPLES_PER_ROUND
            samples += pipe.run([{"query": np.full(4, float(i))} for i in range(first, first + SAMPLES_PER_ROUND)])
        stats = pipe.stats()
    report(stats)
    problems = check(samples, stats)
    for p in problems:
        print("PROBLEM:", p)
    if not problems:
        print(
            "\nOK: all 8 replicas of reference, value and reward worked in both rounds; "
            "every stage processed each of the 32 samples exactly once; rewards joined by sample id."
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
