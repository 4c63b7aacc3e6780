"""PPO with a ~100M-parameter GPT-style policy on one GPU, colocated: phase times, throughput,
the GPU's busy fraction and the weight-sync cost (issue 8; docs/gpu.md).

Six models, random init, built in code (no downloads): a policy that samples ``--tokens`` new
tokens with a KV cache, a reference and a reward model of the same family (the reward scores
the last position), a value model (a value head per position), and PPO trainers for the policy
and the value with bf16 autocast. All share one GPU through fractional GPU resources.

    python3 benchmarks/gpu/scaled.py --episodes 4 --samples 256 --tokens 128    # on the GPU
    python benchmarks/gpu/scaled.py --tiny --episodes 2 --samples 16           # a CPU check
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import threading
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import flowrl

VOCAB, PROMPT = 8192, 16
SIZES = {"full": dict(width=768, layers=12, heads=12), "tiny": dict(width=64, layers=2, heads=4)}
CLIP, KL = 0.2, 0.01


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        n, t, w = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(w, dim=2)
        q, k, v = (z.view(n, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        if cache is not None:  # generation: keys and values of the positions before
            if cache:
                k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
            cache[:] = [k, v]
        att = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None or t > 1)
        x = x + self.proj(att.transpose(1, 2).reshape(n, t, w))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, out: int, size: dict[str, int], tokens: int) -> None:
        super().__init__()
        w = size["width"]
        self.token, self.position = nn.Embedding(VOCAB, w), nn.Embedding(PROMPT + tokens, w)
        self.blocks = nn.ModuleList(Block(w, size["heads"]) for _ in range(size["layers"]))
        self.ln, self.head = nn.LayerNorm(w), nn.Linear(w, out)

    def forward(self, ids: torch.Tensor, caches: list[list[torch.Tensor]] | None = None, start: int = 0) -> torch.Tensor:
        pos = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.token(ids) + self.position(pos)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.ln(x))


def build(out: int, size: dict[str, int], tokens: int) -> GPT:
    torch.manual_seed(0)  # trainers and inference copies start alike
    return GPT(out, size, tokens)


class Sized(flowrl.Model):
    """A model of the GPT family: its size and response length travel with it."""

    out = VOCAB

    def __init__(self, name: str, config: Any, *, size: dict[str, int], tokens: int) -> None:
        super().__init__(name, config)
        self.size, self.tokens = size, tokens

    def build(self) -> GPT:
        return build(self.out, self.size, self.tokens).to(self.device)


def token_logprobs(model: GPT, seq: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the response tokens of ``seq`` ([n, PROMPT + TOKENS])."""
    logits = model(seq[:, :-1])[:, PROMPT - 1:]
    return torch.log_softmax(logits.float(), -1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1)


class Timed(Sized):
    """A GPU model whose every call ends with the GPU done (so a step's time is GPU time)."""

    def setup(self) -> None:
        self.module = self.build().eval()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class Policy(Timed):
    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        ids = torch.as_tensor(batch["prompt"]).to(self.device)
        caches: list[list[torch.Tensor]] = [[] for _ in self.module.blocks]
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.module(ids, caches)[:, -1]
            out = []
            for t in range(self.tokens):
                nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1)
                out.append(nxt)
                if t + 1 < self.tokens:
                    logits = self.module(nxt, caches, start=PROMPT + t)[:, -1]
        seq = torch.cat([ids, *out], 1)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            old = token_logprobs(self.module, seq)
        self.sync()
        return {"seq": seq.cpu(), "old_logprobs": old.cpu()}


class Reference(Timed):
    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        seq = torch.as_tensor(batch["seq"]).to(self.device)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            ref = token_logprobs(self.module, seq)
        self.sync()
        return {"ref_logprobs": ref.cpu()}


class Reward(Timed):
    out = 1

    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        seq = torch.as_tensor(batch["seq"]).to(self.device)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            score = self.module(seq)[:, -1, 0].float()
        self.sync()
        return {"score": score.cpu()}


class Value(Timed):
    out = 1

    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        seq = torch.as_tensor(batch["seq"]).to(self.device)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            values = self.module(seq[:, :-1])[:, PROMPT - 1:, 0].float()
        self.sync()
        return {"values": values.cpu()}


class PPO(Sized):
    def setup(self) -> None:
        self.module = self.build()
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-5)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, float]:
        total = 0.0
        self.optimizer.zero_grad()
        for mb in self.micro_batches(batch):
            fields = {k: torch.as_tensor(mb[k]).to(self.device) for k in ("seq", "old_logprobs", "ref_logprobs",
                                                                          "values", "score")}
            with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
                loss = self.loss(fields)
            (loss / self.global_batch_size).backward()
            total += float(loss.detach())
        self.all_reduce_grads(self.module)
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"loss": total / max(1, len(batch))}

    @staticmethod
    def advantages(f: dict[str, torch.Tensor]) -> torch.Tensor:
        rewards = -KL * (f["old_logprobs"] - f["ref_logprobs"])
        rewards[:, -1] += f["score"]
        return rewards.flip(1).cumsum(1).flip(1) - f["values"]  # returns-to-go minus the baseline

    def loss(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        adv = self.advantages(f)
        ratio = torch.exp(token_logprobs(self.module, f["seq"]) - f["old_logprobs"])
        return -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean(1).sum()


class PPOValue(PPO):
    out = 1

    def loss(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        returns = self.advantages(f) + f["values"]
        values = self.module(f["seq"][:, :-1])[:, PROMPT - 1:, 0].float()
        return 0.5 * ((values - returns) ** 2).mean(1).sum()


def gpu_sampler(stop: threading.Event, out: list[float]) -> None:
    """nvidia-smi's utilisation every 200 ms until ``stop``."""
    proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                             "-lms", "200"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if stop.is_set():
            break
        if line.strip().isdigit():
            out.append(float(line))
    proc.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--policy-replicas", type=int, default=2)
    parser.add_argument("--policy-batch", type=int, default=32, help="the policy's shard size (generation batch)")
    parser.add_argument("--weight-transport", choices=["host", "cuda_ipc"], default="host",
                        help="how the trainers' weights reach the policy and value replicas")
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

    models = [cls(n, cfg(n), size=size, tokens=args.tokens)
              for cls, n in zip((Policy, Reference, Reward, Value, PPO, PPOValue), names)]
    params = sum(p.numel() for p in build(VOCAB, size, args.tokens).parameters())
    config = {"sample_per_episode": args.samples, "num_episode": args.episodes, "train_global_batch_size": 64,
              "train_micro_batch_size": 16, "progress": "log",
              "colocation": [names] if on_gpu else [],
              "pipeline": {"backend": "ray" if on_gpu else "inprocess"}}
    engine = flowrl.RLHFEngine(*models, config)
    engine.set_dataset([{"prompt": torch.randint(0, VOCAB, (PROMPT,), generator=torch.Generator().manual_seed(i))}
                        for i in range(args.samples * 2)])
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
    report(stats, args, params, util, wall, on_gpu, busy_fractions(engine.spans()))


def covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside at least one of ``intervals``."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def busy_fractions(spans: list[Any]) -> dict[str, float]:
    """Per phase (episodes 1..): the median share of its time in which some model ran a step.
    Every step here ends by synchronising the GPU, so that is the time the GPU had work."""
    steps = [(s.start, s.end) for s in spans if s.group not in ("engine", "autoscale")]
    out: dict[str, list[float]] = {}
    for s in spans:
        if s.group == "engine" and s.args.get("episode", 0) >= 1 and s.end > s.start:
            out.setdefault(s.name, []).append(covered(steps, s.start, s.end) / (s.end - s.start))
    return {phase: statistics.median(v) for phase, v in out.items()}


def report(stats: flowrl.EngineStats, args: argparse.Namespace, params: int, util: list[float], wall: float,
           on_gpu: bool, busy: dict[str, float]) -> None:
    eps = stats.episodes[1:] or stats.episodes  # the first episode warms up (CUDA kernels, allocator)
    med = lambda xs: statistics.median(xs) if xs else math.nan  # noqa: E731
    rollout, train, sync = (med([getattr(e, f"{k}_s") for e in eps]) for k in ("rollout", "train", "sync"))
    tokens = args.samples * args.tokens
    rows = [("rollout (all four inference models)", rollout, args.samples / rollout, tokens / rollout,
             busy.get("rollout", math.nan)),
            ("train (both PPO trainers)", train, args.samples / train, tokens / train, busy.get("train", math.nan)),
            ("weight sync (both)", sync, math.nan, math.nan, busy.get("sync", math.nan))]
    per_model = {s.model: s.busy_s for s in stats.rollout.stages.values()}
    print(f"\n{params / 1e6:.0f}M parameters per model, {args.samples} samples x {args.tokens} tokens, "
          f"policy shards of {args.policy_batch}, weights by {args.weight_transport}, "
          f"{len(stats.episodes)} episodes, on {'GPU' if on_gpu else 'CPU'}; medians of episodes 1..")
    print("| phase | s | samples/s | tokens/s | GPU busy |\n| --- | --- | --- | --- | --- |")
    for name, s, sps, tps, frac in rows:
        print(f"| {name} | {s:.2f} | {sps:.1f} | {tps:.0f} | {frac:.0%} |")
    print("\n| model | busy s (all episodes) | busy / rollout time |\n| --- | --- | --- |")
    total_rollout = sum(e.rollout_s for e in stats.episodes)
    for model, b in per_model.items():
        print(f"| {model} | {b:.2f} | {b / total_rollout:.2f} |")
    for name, t in stats.trainers.items():
        print(f"| {name} (train) | {sum(r.busy_s for r in t.ranks):.2f} | |")
    if util:
        print(f"\nnvidia-smi utilisation over the run ({len(util)} samples, 200 ms): mean {statistics.mean(util):.0f}%, "
              f"median {statistics.median(util):.0f}%")
    print(f"wall {wall:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"params": params, "episodes": [{k: getattr(e, k) for k in ("episode", "rollout_s", "train_s",
                                                                              "sync_s")} for e in stats.episodes],
                       "busy": per_model, "phase_busy": busy, "util": util, "wall": wall}, f, indent=1)


if __name__ == "__main__":
    main()
