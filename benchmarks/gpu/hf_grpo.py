"""GRPO through flowrl.hf on one GPU: a policy and its trainer colocated on the GPU (weights by
CUDA IPC, trainer in bf16 autocast over fp32 weights), a rule reward on the CPU, on Ray.

Models of real architectures with random weights (built from their configs): the generation
runs to ``max_new_tokens`` (a random model seldom samples its eos), which is what a throughput
figure wants. GPU busy is sampled by ``nvidia-smi`` every 100 ms over the whole engine run.

    python benchmarks/gpu/hf_grpo.py --arch smollm2-135m --tokenizer DIR --out OUT
Writes OUT/hf-grpo-<arch>.json: per-episode phases, stage busy seconds, tokens/s, GPU busy.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import flowrl
from flowrl import hf

ARCHS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {  # SmolLM2-135M-Instruct's config
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
    },
    "qwen2.5-0.5b": {  # Qwen2.5-0.5B's config
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
    },
}


class GpuBusy:
    """``nvidia-smi``'s utilization.gpu of every GPU, sampled every 100 ms while running."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.timed: list[tuple[float, int, float]] = []  # (wall clock, GPU index, utilization)
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=subprocess.PIPE,
            text=True,
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                index, value = (float(x) for x in line.split(",")[:2])
            except ValueError:
                continue
            self.samples.append(value)
            self.timed.append((time.time(), int(index), value))

    def per_gpu(self, windows: list[tuple[float, float]]) -> dict[int, dict[str, float]]:
        """Each GPU's median and mean utilization over the samples inside ``windows``."""
        inside: dict[int, list[float]] = {}
        for t, index, value in self.timed:
            if any(a <= t <= b for a, b in windows):
                inside.setdefault(index, []).append(value)
        return {i: {"median": statistics.median(v), "mean": statistics.fmean(v)} for i, v in sorted(inside.items())}

    def stop(self) -> dict[str, float]:
        self._proc.terminate()
        self._thread.join(timeout=5)
        s = self.samples or [float("nan")]
        return {"median": statistics.median(s), "mean": statistics.fmean(s), "samples": len(self.samples)}


def make_engine(args: argparse.Namespace) -> flowrl.Engine:
    lm = hf.LM(config=ARCHS[args.arch], tokenizer=args.tokenizer, dtype="bfloat16")
    gpu = {"num_replicas": 1, "gpus_per_replica": 0.5, "cpus_per_replica": 1}
    policy = hf.HFPolicy(
        "policy",
        {**gpu, "batch_size": args.prompts * args.group},
        lm=lm,
        sampling={"max_new_tokens": args.max_new_tokens, "temperature": 1.0},
    )
    reward = hf.RuleReward("reward", {"batch_size": 256, "cpus_per_replica": 1}, fn=exact)
    trainer = hf.GRPOTrainer(
        "grpo",
        {**gpu, "weight_transport": "cuda_ipc"},
        lm=hf.LM(config=ARCHS[args.arch], tokenizer=args.tokenizer),
        optim={"lr": 1e-6},
        train={"micro_batch_tokens": args.micro_batch_tokens},
    )

    def rollout(prompts: Any) -> Any:
        return reward.forward_step(policy.forward_step(prompts))

    config = flowrl.RunConfig(
        sample_per_episode=args.prompts * args.group,
        num_samples_per_prompt=args.group,
        num_episode=args.episodes,
        train_global_batch_size=args.prompts * args.group,
        num_training_epoch=1,
        colocation=[["policy", "grpo"]],
        progress="off",
    )
    engine = flowrl.Engine(rollout=rollout, train=[trainer], sync=[(trainer, policy)], config=config)
    rng = random.Random(0)
    pairs = [(rng.randint(1, 99), rng.randint(1, 99)) for _ in range(args.prompts * args.episodes)]
    engine.set_dataset([{"prompt": f"What is {a} + {b}?", "answer": a + b} for a, b in pairs])
    return engine


def exact(prompt: str, response: str, answer: int, **_: Any) -> float:
    return float(response.strip() == str(answer))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", choices=sorted(ARCHS), default="smollm2-135m")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--episodes", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=32768)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False)
    busy = GpuBusy()
    start = time.perf_counter()
    stats = make_engine(args).learn()
    wall = time.perf_counter() - start
    gpu = busy.stop()
    ray.shutdown()
    report = summarise(args, stats, wall, gpu)
    path = Path(args.out) / f"hf-grpo-{args.arch}.json"
    path.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "episodes"}, indent=1))


def summarise(
    args: argparse.Namespace, stats: flowrl.EngineStats, wall: float, gpu: dict[str, float]
) -> dict[str, Any]:
    episodes = [
        {
            "rollout_s": e.rollout_s,
            "train_s": e.train_s,
            "sync_s": e.sync_s,
            "response_length": e.metrics["grpo"].get("response_length", float("nan")),
        }
        for e in stats.episodes
    ]
    later = episodes[1:] or episodes  # the first episode includes CUDA and kernel warm-up
    tokens = [e["response_length"] * args.prompts * args.group for e in later]
    assert stats.rollout is not None
    stages = {name: s.busy_s for name, s in stats.rollout.stages.items()}
    generate_s = stages.get("policy.forward_step", float("nan"))
    return {
        "arch": args.arch,
        "samples_per_episode": args.prompts * args.group,
        "max_new_tokens": args.max_new_tokens,
        "wall_s": wall,
        "gpu_busy_percent": gpu,
        "stage_busy_s": stages,
        "generated_tokens_per_s_in_rollout": sum(tokens) / sum(e["rollout_s"] for e in later),
        "generated_tokens_all_episodes": sum(e["response_length"] * args.prompts * args.group for e in episodes),
        "policy_busy_s_all_episodes": generate_s,
        "median_after_first": {k: statistics.median(e[k] for e in later) for k in ("rollout_s", "train_s", "sync_s")},
        "episodes": episodes,
    }


if __name__ == "__main__":
    main()
