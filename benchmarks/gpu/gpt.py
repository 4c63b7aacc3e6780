"""The GPT family of the GPU benchmarks (docs/gpu.md): a ~100M-parameter policy that samples
with a KV cache, a reference and a reward of the same family, a value model, PPO trainers with
bf16 autocast, and the prompts (random init and data, built in code: no downloads).

A random policy never samples an end of sequence, so each prompt carries the response length
at which it ends (``length``): all ``tokens`` with ``--lengths full``, or drawn from a
lognormal (median a quarter of ``tokens``, 8% capped at ``tokens``) with ``--lengths eos``,
the long tail of RL responses. A shard generates until its longest response ends, as batched
generation without continuous batching does; positions after a response's end are padding.
"""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import flowrl

if TYPE_CHECKING:
    import threading

VOCAB, PROMPT = 8192, 16
SIZES = {"full": {"width": 768, "layers": 12, "heads": 12}, "tiny": {"width": 64, "layers": 2, "heads": 4}}
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

    def forward(
        self, ids: torch.Tensor, caches: list[list[torch.Tensor]] | None = None, start: int = 0
    ) -> torch.Tensor:
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


def response_mask(length: torch.Tensor, tokens: int) -> torch.Tensor:
    """1 on the positions of each response before its end, 0 on the padding after it."""
    return (torch.arange(tokens, device=length.device) < length[:, None]).to(torch.long)


def token_logprobs(model: GPT, seq: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the response tokens of ``seq`` ([n, PROMPT + TOKENS])."""
    logits = model(seq[:, :-1])[:, PROMPT - 1 :]
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
        length = torch.as_tensor(batch["length"]).to(self.device)
        caches: list[list[torch.Tensor]] = [[] for _ in self.module.blocks]
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            logits = self.module(ids, caches)[:, -1]
            out = []
            longest = int(length.max())  # the shard runs until its longest response ends
            for t in range(longest):
                nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1)
                out.append(nxt)
                if t + 1 < longest:
                    logits = self.module(nxt, caches, start=PROMPT + t)[:, -1]
        response = F.pad(torch.cat(out, 1), (0, self.tokens - longest))
        seq = torch.cat([ids, response * response_mask(length, self.tokens)], 1)
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
            last = PROMPT + torch.as_tensor(batch["length"]).to(self.device) - 1  # each response's end
            score = self.module(seq)[torch.arange(len(seq), device=self.device), last, 0].float()
        self.sync()
        return {"score": score.cpu()}


class Value(Timed):
    out = 1

    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        seq = torch.as_tensor(batch["seq"]).to(self.device)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.device.type == "cuda"):
            values = self.module(seq[:, :-1])[:, PROMPT - 1 :, 0].float()
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
            fields = {
                k: torch.as_tensor(mb[k]).to(self.device)
                for k in ("seq", "length", "old_logprobs", "ref_logprobs", "values", "score")
            }
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
        mask = response_mask(f["length"], f["values"].shape[1])
        rewards = -KL * (f["old_logprobs"] - f["ref_logprobs"]) * mask
        rewards[torch.arange(len(rewards)), f["length"] - 1] += f["score"]  # scored at each response's end
        return (rewards.flip(1).cumsum(1).flip(1) - f["values"]) * mask  # returns-to-go minus the baseline

    @staticmethod
    def per_sample(x: torch.Tensor, f: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each response's mean of ``x`` over its positions, summed over the micro-batch."""
        return ((x * response_mask(f["length"], x.shape[1])).sum(1) / f["length"]).sum()

    def loss(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        adv = self.advantages(f)
        ratio = torch.exp(token_logprobs(self.module, f["seq"]) - f["old_logprobs"])
        return -self.per_sample(torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv), f)


class PPOValue(PPO):
    out = 1

    def loss(self, f: dict[str, torch.Tensor]) -> torch.Tensor:
        returns = self.advantages(f) + f["values"]
        values = self.module(f["seq"][:, :-1])[:, PROMPT - 1 :, 0].float()
        return self.per_sample(0.5 * (values - returns) ** 2, f)


def gpu_sampler(stop: threading.Event, out: list[float]) -> None:
    """nvidia-smi's utilisation every 200 ms until ``stop``."""
    proc = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "200"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if stop.is_set():
            break
        if line.strip().isdigit():
            out.append(float(line))
    proc.terminate()


def prompts(n: int, tokens: int, lengths: str) -> list[dict[str, Any]]:
    """``n`` random prompts of ``PROMPT`` tokens, each with the length its response ends at."""
    rng = np.random.default_rng(0)
    if lengths == "full":
        ends = np.full(n, tokens)
    else:  # lognormal, median tokens / 4; sigma 1 caps 8% at tokens
        ends = np.clip(np.rint(tokens / 4 * np.exp(rng.normal(0.0, 1.0, n))), 1, tokens).astype(int)
    return [{"prompt": torch.as_tensor(rng.integers(0, VOCAB, PROMPT)), "length": int(e)} for e in ends]


def covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] inside at least one of ``intervals``."""
    total, end = 0.0, lo
    for a, b in sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi):
        if b > end:
            total += b - max(a, end)
            end = b
    return total
