"""PPO with a ~100M-parameter GPT-style policy on one GPU, colocated: per-phase times,
throughput, the GPU's busy fraction and the weight-sync cost (issue 8; docs/gpu.md).

Six models of the GPT family in ``gpt.py`` (random init, built in code): a policy sampling up to
``--tokens`` new tokens with a KV cache, a reference, a reward, a value model, and PPO trainers
for the policy and the value with bf16 autocast. All share one GPU through fractional GPU
resources (``colocation``); with ``--apart`` the trainers share one GPU and the inference models
another (for ``--weight-transport nccl``, with one policy replica: NCCL takes one rank per GPU).

    python3 benchmarks/gpu/scaled.py --episodes 5 --samples 256 --tokens 128    # on the GPU
    python benchmarks/gpu/scaled.py --tiny --episodes 2 --samples 16 --tokens 8  # a CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import flowrl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import (
    PPO,
    SIZES,
    VOCAB,
    Policy,
    PPOValue,
    Reference,
    Reward,
    Value,
    build,
    covered,  # noqa: E402
    gpu_sampler,
    prompts,
)

INFERENCE = ("policy", "reference", "value", "reward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=5)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--lengths",
        choices=["full", "eos"],
        default="full",
        help="every response --tokens long, or ending at lognormal lengths (gpt.py)",
    )
    parser.add_argument("--policy-replicas", type=int, default=2)
    parser.add_argument("--policy-batch", type=int, default=32, help="the policy's shard size (generation batch)")
    parser.add_argument(
        "--weight-transport",
        choices=["host", "cuda_ipc", "nccl"],
        default="host",
        help="how the trainers' weights reach the policy and value replicas",
    )
    parser.add_argument(
        "--apart",
        action="store_true",
        help="the trainers on one GPU, the inference models on another (else all on one)",
    )
    parser.add_argument("--tiny", action="store_true", help="small models on the CPU, in one process (a check)")
    parser.add_argument("--out", help="write the figures here (JSON)")
    args = parser.parse_args()
    size = SIZES["tiny" if args.tiny else "full"]
    on_gpu = torch.cuda.is_available() and not args.tiny
    names = ["policy", "reference", "reward", "value", "ppo_policy", "ppo_value"]
    replicas = {"policy": args.policy_replicas}

    def cfg(name: str) -> dict[str, Any]:  # on a GPU, each model's replicas hold one GPU together
        n = replicas.get(name, 1)
        gpu = {"gpus_per_replica": 1 / n, "cpus_per_replica": 1} if on_gpu else {"cpus_per_replica": 0.5}
        sync = {"weight_transport": args.weight_transport} if name.startswith("ppo") else {}
        return {"num_replicas": n, "batch_size": args.policy_batch if name == "policy" else 64, **gpu, **sync}

    models = [
        cls(n, cfg(n), size=size, tokens=args.tokens)
        for cls, n in zip((Policy, Reference, Reward, Value, PPO, PPOValue), names, strict=True)
    ]
    params = sum(p.numel() for p in build(VOCAB, size, args.tokens).parameters())
    config = {
        "sample_per_episode": args.samples,
        "num_episode": args.episodes,
        "train_global_batch_size": 64,
        "train_micro_batch_size": 16,
        "progress": "log",
        "colocation": ([names[4:], names[:4]] if args.apart else [names]) if on_gpu else [],
        "pipeline": {"backend": "ray" if on_gpu else "inprocess"},
    }
    engine = flowrl.RLHFEngine(*models, config)
    data = prompts(args.samples, args.tokens, args.lengths)  # every episode: the same prompts, a new order
    engine.set_dataset(data)
    util: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=gpu_sampler, args=(stop, util), daemon=True) if on_gpu else None
    started = time.perf_counter()
    with engine:
        if sampler is not None:
            sampler.start()
        stats = engine.learn()
        stop.set()
    wall = time.perf_counter() - started
    tokens = sum(d["length"] for d in data)
    figures = phases(engine.spans(), [*INFERENCE, "ppo_policy", "ppo_value"])
    report(figures, stats, args, params, tokens, util, wall, on_gpu)


def phases(spans: list[Any], models: list[str]) -> dict[str, tuple[float, float]]:
    """Medians over episodes 1.. (episode 0 warms up: CUDA kernels, the allocator) of each
    engine phase's time and of each model's busy time (some replica or rank inside a step), as
    ``name: (seconds, share of the phase's time in which any model was busy)``. Every step
    here ends by synchronising the GPU, so a step's span is time the GPU had work."""
    steps = {m: [(s.start, s.end) for s in spans if s.group == m] for m in models}
    every = [iv for m in models for iv in steps[m]]
    out: dict[str, list[tuple[float, float]]] = {}
    for ph in spans:
        if ph.group != "engine" or ph.args.get("episode", 0) < 1 or ph.end <= ph.start:
            continue
        wall = ph.end - ph.start
        out.setdefault(ph.name, []).append((wall, covered(every, ph.start, ph.end) / wall))
        for m in models:
            busy = covered(steps[m], ph.start, ph.end)
            if busy > 0:
                out.setdefault(f"{ph.name}: {m}", []).append((busy, busy / wall))
    return {k: (statistics.median(a for a, _ in v), statistics.median(b for _, b in v)) for k, v in out.items()}


def report(
    figures: dict[str, tuple[float, float]],
    stats: flowrl.EngineStats,
    args: argparse.Namespace,
    params: int,
    tokens: int,
    util: list[float],
    wall: float,
    on_gpu: bool,
) -> None:
    print(
        f"\n{params / 1e6:.0f}M parameters per model, {args.samples} samples, responses of {args.lengths} length "
        f"(at most {args.tokens} tokens, {tokens} in all), policy shards of {args.policy_batch}, weights by "
        f"{args.weight_transport}{' (trainers and inference on two GPUs)' if args.apart else ''}, "
        f"{len(stats.episodes)} episodes, on {'GPU' if on_gpu else 'CPU'}; "
        "medians of episodes 1.."
    )
    print("| phase | s | samples/s | tokens/s | GPU busy |\n| --- | --- | --- | --- | --- |")
    for name, (s, frac) in figures.items():
        rate = "| | |" if name.startswith("sync") else f"| {args.samples / s:.1f} | {tokens / s:.0f} |"
        label = name if ":" in name else f"**{name}**"
        print(f"| {label} | {s:.2f} {rate} {frac:.0%} |")
    print("\n(a model's row: seconds some replica of it was inside a step, and that share of the phase)")
    if util:
        print(
            f"nvidia-smi utilisation over the run ({len(util)} samples, 200 ms): mean {statistics.mean(util):.0f}%, "
            f"median {statistics.median(util):.0f}%"
        )
    print(
        f"wall {wall:.1f} s; episode rollout/train/sync s: "
        + ", ".join(f"{e.rollout_s:.2f}/{e.train_s:.2f}/{e.sync_s:.2f}" for e in stats.episodes)
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "params": params,
                    "tokens": tokens,
                    "phases": figures,
                    "util": util,
                    "wall": wall,
                    "episodes": [
                        {k: getattr(e, k) for k in ("episode", "rollout_s", "train_s", "sync_s")}
                        for e in stats.episodes
                    ],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
