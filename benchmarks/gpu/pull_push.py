"""flowrl's pull scheduling against ChatLearn's static push, on the GPU rollout of the ~100M
GPT family (issue 8; docs/gpu.md): the same four models, replica counts, GPU shares, batch
sizes and prompts, run episode by episode in turns in one process, so both see the same
machine.

- pull: a flowrl pipeline (policy -> reference and value -> reward); idle replicas take shards
  cut on demand.
- push: ChatLearn's static push, as in ``flowrl loadtest``: the episode's prompts in policy
  batches, batch i to replica i mod n of every model, each batch whole through the flow.

Responses end at lognormal lengths (``--lengths eos``, see gpt.py), so a policy batch costs
its longest response: the cost that static batches cannot spread.

    python3 benchmarks/gpu/pull_push.py --episodes 5                       # on the GPU
    python benchmarks/gpu/pull_push.py --tiny --episodes 2 --samples 32 --tokens 8   # a CPU check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

import flowrl
from flowrl._backends.replica import micro_batches
from flowrl._sim.push import push_batches, push_replica

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpt  # noqa: E402
from gpt import SIZES, Policy, Reference, Reward, Value, covered, prompts  # noqa: E402

ROLES = {"policy": Policy, "reference": Reference, "value": Value, "reward": Reward}
Span = tuple[str, int, float, float]  # model, replica, start, end (wall clock)


def build_models(args: argparse.Namespace, on_gpu: bool) -> dict[str, flowrl.Model]:
    counts = {"policy": args.policy_replicas} | {m: args.scorer_replicas for m in ROLES if m != "policy"}
    share = 0.5 / sum(counts.values())  # both systems' replicas are alive at once: half the GPU each
    size = SIZES["tiny" if args.tiny else "full"]
    return {
        m: cls(
            m,
            {
                "num_replicas": counts[m],
                "batch_size": args.policy_batch if m == "policy" else 64,
                "cpus_per_replica": 0.5,
                **({"gpus_per_replica": share} if on_gpu else {}),
            },
            size=size,
            tokens=args.tokens,
        )
        for m, cls in ROLES.items()
    }


def rollout_flow(models: dict[str, flowrl.Model]) -> Any:
    policy, reference, value, reward = (models[m] for m in ROLES)

    def rollout(batch: Any) -> Any:
        out = policy.forward_step(batch)
        return reward.forward_step(out, reference.forward_step(out), value.forward_step(out))

    return rollout


@ray.remote
class PushReplica:
    """One replica of one model for the push baseline: the model's own class and setup."""

    def __init__(self, model: flowrl.Model, replica: int) -> None:
        model.replica_id, model.gpu_ids = replica, [int(g) for g in ray.get_gpu_ids()]
        model.setup()
        self.model = model

    def ready(self) -> bool:
        return True

    @ray.method(num_returns=2)
    def run(self, *parts: flowrl.Batch) -> tuple[flowrl.Batch, Span]:
        batch = parts[0]
        for part in parts[1:]:
            batch = batch.merge(part)
        start = time.time()
        # as ChatLearn: the whole upstream batch in one call, run in steps of the model's batch_size
        self.model.begin_shard(batch)
        parts = micro_batches(batch, self.model.config.batch_size)
        outs = [flowrl.Batch(part.ids, dict(self.model.forward_step(part, 0))) for part in parts]
        new = outs[0] if len(outs) == 1 else flowrl.Batch.concat(outs)
        end = time.time()
        # the policy's batch carries its inputs on; a scorer sends back its own fields only
        return (batch.merge(new) if self.model.name == "policy" else new), (
            self.model.name,
            self.model.replica_id,
            start,
            end,
        )


class Push:
    """ChatLearn's static push over ``PushReplica`` actors."""

    def __init__(self, models: dict[str, flowrl.Model], on_gpu: bool) -> None:
        self.actors: dict[str, list[Any]] = {}
        for name, model in models.items():
            cfg = model.config
            opts = {"num_cpus": cfg.cpus_per_replica, "num_gpus": cfg.gpus_per_replica if on_gpu else 0}
            self.actors[name] = [PushReplica.options(**opts).remote(model, r) for r in range(cfg.replicas)]
        self.batch = models["policy"].config.batch_size
        ray.get([a.ready.remote() for group in self.actors.values() for a in group])

    def run(self, items: list[dict[str, Any]]) -> tuple[int, list[Span]]:
        policy, reference, value, reward = (self.actors[m] for m in ROLES)
        done, spans = [], []
        for i, ids in enumerate(push_batches(len(items), self.batch)):
            batch = flowrl.Batch.from_samples(list(ids), [items[j] for j in ids])
            out, s1 = policy[push_replica(i, len(policy))].run.remote(batch)
            ref, s2 = reference[push_replica(i, len(reference))].run.remote(out)
            val, s3 = value[push_replica(i, len(value))].run.remote(out)
            score, s4 = reward[push_replica(i, len(reward))].run.remote(out, ref, val)
            done.append(score)
            spans += [s1, s2, s3, s4]
        return sum(len(b) for b in ray.get(done)), ray.get(spans)

    def close(self) -> None:
        for group in self.actors.values():
            for actor in group:
                ray.kill(actor)


def measure(spans: list[Span], start: float, end: float, models: list[str]) -> dict[str, float]:
    """The episode's time, each model's busy seconds (some replica inside a step) and the share
    of the episode in which some model was busy (each step ends by synchronising the GPU)."""
    out = {"s": end - start, "busy": covered([(a, b) for _, _, a, b in spans], start, end) / (end - start)}
    for m in models:
        out[m] = covered([(a, b) for name, _, a, b in spans if name == m], start, end)
        per_replica = [
            sum(b - a for name, r, a, b in spans if name == m and r == i)
            for i in sorted({r for name, r, _, _ in spans if name == m})
        ]
        out[f"{m} spread"] = max(per_replica) - min(per_replica) if per_replica else 0.0
    return out


def pull_episode(pipe: flowrl.Pipeline, items: list[dict[str, Any]]) -> tuple[int, float, float, list[Span]]:
    before = len(pipe.timeline.spans)
    start = time.time()
    samples = pipe.run(items, fields=["score"])
    end = time.time()
    spans = [(s.group, s.lane, s.start, s.end) for s in pipe.timeline.spans[before:]]
    return len(samples), start, end, spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=5, help="per system; the first warms up")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--lengths", choices=["full", "eos"], default="eos")
    parser.add_argument("--policy-replicas", type=int, default=4)
    parser.add_argument("--scorer-replicas", type=int, default=2, help="replicas of reference, value and reward")
    parser.add_argument("--policy-batch", type=int, default=32)
    parser.add_argument("--tiny", action="store_true", help="small models on the CPU (a check)")
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and not args.tiny
    if not ray.is_initialized():
        ray.init(num_cpus=max(16, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    models = build_models(args, on_gpu)
    data = prompts(args.samples, args.tokens, args.lengths)
    tokens = sum(d["length"] for d in data)
    rng = np.random.default_rng(1)
    results: dict[str, list[dict[str, float]]] = {"pull": [], "push": []}
    push = Push(models, on_gpu)
    try:
        with flowrl.Pipeline(rollout_flow(models), {"backend": "ray", "progress": "off"}) as pipe:
            for e in range(args.episodes):
                items = [data[i] for i in rng.permutation(len(data))]  # the same order for both
                for system in ("pull", "push") if e % 2 == 0 else ("push", "pull"):
                    if system == "pull":
                        n, start, end, spans = pull_episode(pipe, items)
                    else:
                        start = time.time()
                        n, spans = push.run(items)
                        end = time.time()
                    assert n == len(items), f"{system} returned {n} of {len(items)} samples"
                    if e:  # the first episode of each warms up (CUDA kernels, allocator)
                        results[system].append(measure(spans, start, end, list(ROLES)))
                    print(f"episode {e} {system}: {end - start:.2f} s", flush=True)
        shards = {st.model: st.shard_sizes for st in pipe.stats().stages.values()}
    finally:
        push.close()
    report(results, args, tokens, on_gpu)
    print(f"pull's shard sizes (size: calls, all episodes): {shards}")


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace, tokens: int, on_gpu: bool) -> None:
    med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in results.items()}
    ratios = [b["s"] / a["s"] for a, b in zip(results["pull"], results["push"], strict=True)]
    print(
        f"\n{args.samples} samples, responses {args.lengths} (at most {args.tokens} tokens, {tokens} in all), "
        f"policy {args.policy_replicas} replicas x batch {args.policy_batch}, reference/value/reward "
        f"{args.scorer_replicas} each, on {'GPU' if on_gpu else 'CPU'}; medians of {len(ratios)} episodes each"
    )
    print(
        "| system | rollout s | samples/s | tokens/s | GPU busy | policy busy s | policy replica spread s "
        "| reference / value / reward busy s |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for system, m in med.items():
        print(
            f"| {system} | {m['s']:.2f} | {args.samples / m['s']:.1f} | {tokens / m['s']:.0f} | {m['busy']:.0%} "
            f"| {m['policy']:.2f} | {m['policy spread']:.2f} "
            f"| {m['reference']:.2f} / {m['value']:.2f} / {m['reward']:.2f} |"
        )
    print(
        f"\npush / pull per episode: {', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x"
    )


if __name__ == "__main__":
    ray.cloudpickle.register_pickle_by_value(gpt)  # workers lack this folder on their path
    main()
