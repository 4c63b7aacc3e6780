"""PPO on a toy task with six tiny torch models — it really learns, on two CPU cores.

Task: the prompt is one token p of a vocabulary of 8; the policy writes 4 tokens; the reward
is the fraction of them that count up from the prompt: p+1, p+2, p+3, p+4 (mod 8). A random
policy scores 1/8; PPO pushes the mean reward towards 1 within a few dozen episodes.

Models (ChatLearn's six): policy (sampling, a tiny causal LM), reference (frozen copy,
for the KL penalty), reward (scores responses), value (a value head), ppo_policy and
ppo_value (trainers with clipped objectives and GAE). Weights flow ppo_policy -> policy and
ppo_value -> value after every episode.

    python examples/ppo_tiny.py                  # Ray backend, prints the reward curve; a GPU is used if present
    python examples/ppo_tiny.py --tensorboard runs/ppo_tiny       # then: tensorboard --logdir runs/ppo_tiny
    python examples/ppo_tiny.py --episodes 40 --plot reward.png   # pip install matplotlib first
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn

import flowrl
from flowrl.rl import sample_rows

VOCAB, LENGTH, HIDDEN, SEED = 8, 4, 32, 0
KL_COEF, CLIP, GAMMA, LAMBDA = 0.01, 0.2, 1.0, 0.95


class TinyLM(nn.Module):
    """Next-token logits from the previous token and the position (a Markov 'causal LM')."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(VOCAB, HIDDEN)
        self.position = nn.Embedding(LENGTH, HIDDEN)
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, VOCAB))

    def forward(self, previous: torch.Tensor) -> torch.Tensor:  # [n, L] -> [n, L, V]
        steps = torch.arange(previous.shape[1], device=previous.device)
        return self.head(self.token(previous) + self.position(steps))


class ValueHead(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.head[-1] = nn.Linear(HIDDEN, 1)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:  # [n, L]
        return super().forward(previous).squeeze(-1)


def build(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(SEED)  # trainer and inference copies start from the same weights
    return cls()


def previous_tokens(prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    return torch.cat([prompt[:, None], response[:, :-1]], dim=1)


def logprobs(model: nn.Module, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    logits = model(previous_tokens(prompt, response))
    return torch.log_softmax(logits, -1).gather(-1, response[..., None]).squeeze(-1)


def on(device: torch.device, batch: flowrl.Batch | dict[str, Any], *fields: str) -> list[torch.Tensor]:
    """``fields`` of ``batch`` as tensors on ``device`` (the GPU when the replica holds one)."""
    return [torch.as_tensor(batch[f]).to(device) for f in fields]


class Policy(flowrl.Model):
    def setup(self) -> None:
        self.module = build(TinyLM).to(self.device).eval()

    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        (prompt,) = on(self.device, batch, "prompt")
        prompt = prompt.long()
        # each sample draws from its own stream (the run's seed, the stage, its id): the same
        # tokens whichever replica and shard it lands in
        generators = batch.generators(self.device)
        tokens = [prompt]
        for t in range(LENGTH):  # sampling with a running prefix (the KV cache of a real LM)
            step = torch.stack(tokens[-1:], 1)
            logits = self.module.head(self.module.token(step[:, -1]) + self.module.position.weight[t])
            tokens.append(sample_rows(torch.softmax(logits, -1), generators))
        response = torch.stack(tokens[1:], 1)
        return {"response": response.cpu(), "old_logprobs": logprobs(self.module, prompt, response).cpu()}


class Reference(flowrl.Model):
    def setup(self) -> None:
        self.module = build(TinyLM).to(self.device).eval()

    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        prompt, response = on(self.device, batch, "prompt", "response")
        return {"ref_logprobs": logprobs(self.module, prompt.long(), response).cpu()}


class Value(flowrl.Model):
    def setup(self) -> None:
        self.module = build(ValueHead).to(self.device).eval()

    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        prompt, response = on(self.device, batch, "prompt", "response")
        return {"values": self.module(previous_tokens(prompt.long(), response)).cpu()}


class Reward(flowrl.Model):
    """Scores a response: the fraction of tokens that count up from the prompt."""

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        prompt, response = torch.as_tensor(batch["prompt"]).long(), batch["response"]
        target = (prompt[:, None] + torch.arange(1, LENGTH + 1)) % VOCAB
        return {"score": (response == target).float().mean(1)}


def advantages(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the response tokens; per-token KL penalty, the score at the last token."""
    rewards = -KL_COEF * (batch["old_logprobs"] - batch["ref_logprobs"])
    rewards[:, -1] += batch["score"]
    values = batch["values"]
    adv = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(LENGTH)):
        following = values[:, t + 1] if t + 1 < LENGTH else torch.zeros_like(running)
        delta = rewards[:, t] + GAMMA * following - values[:, t]
        running = delta + GAMMA * LAMBDA * running
        adv[:, t] = running
    return adv, adv + values


class Trainer(flowrl.Model):
    """Trains ``self.module``: one optimizer step per global batch on ``loss`` (summed over a
    micro-batch's tokens), divided by the global batch: exact whatever the shard sizes."""

    net: type[nn.Module] = TinyLM
    fields = ("prompt", "response", "old_logprobs", "ref_logprobs", "values", "score")  # what a loss reads

    def setup(self) -> None:
        self.module = build(self.net).to(self.device)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=1e-2)

    def loss(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def step(self, batch: flowrl.Batch) -> float:
        """One optimizer step; the mean loss per token of this rank's shard."""
        self.optimizer.zero_grad()
        total = 0.0
        for mb in self.micro_batches(batch):
            loss = self.loss(dict(zip(self.fields, on(self.device, mb, *self.fields), strict=True)))
            (loss / (self.global_batch_size * LENGTH)).backward()
            total += float(loss.detach())
        self.all_reduce_grads(self.module)
        self.optimizer.step()
        return total / max(1, len(batch) * LENGTH)


def mean_score(batch: flowrl.Batch) -> float:
    return float(batch["score"].mean()) if len(batch) else 0.0


class PPOPolicy(Trainer):
    def loss(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        adv, _ = advantages(mb)  # not whitened per micro-batch: that would tie the gradient to the split
        ratio = torch.exp(logprobs(self.module, mb["prompt"].long(), mb["response"]) - mb["old_logprobs"])
        return -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).sum()

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, float]:
        return {"policy_loss": self.step(batch), "reward": mean_score(batch)}  # the reward curve, in every logger


class PPOValue(Trainer):
    net = ValueHead

    def loss(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        _, returns = advantages(mb)
        values = self.module(previous_tokens(mb["prompt"].long(), mb["response"]))
        return 0.5 * ((values - returns) ** 2).sum()

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, float]:
        return {"value_loss": self.step(batch)}


def on_gpu(backend: str) -> bool:
    """A CUDA GPU here, and replicas that can hold it (Ray): every model but the reward then
    takes a tenth of it and computes there (``self.device`` is cuda)."""
    return backend == "ray" and torch.cuda.is_available()


def make_engine(
    episodes: int,
    backend: str = "ray",
    trainer_ranks: int = 2,
    loggers: list[Any] | None = None,
    seed: int = 0,
    rollout: tuple[int, int, int, int] = (2, 16, 1, 32),
    **extra: Any,
) -> flowrl.RLHFEngine:
    """``rollout``: (policy replicas, their shard size, reference and value replicas, theirs);
    ``extra``: more ``RunConfig`` keys."""
    cpu = {"cpus_per_replica": 0.25}
    gpu = {**cpu, "gpus_per_replica": 0.1} if on_gpu(backend) else cpu
    config = flowrl.RunConfig(
        sample_per_episode=64,
        num_episode=episodes,
        train_global_batch_size=32,
        train_micro_batch_size=16,
        num_training_epoch=4,
        shuffle=True,
        seed=seed,  # the prompts' order and every sample's random stream
        loggers=loggers or [],
        pipeline=flowrl.PipelineConfig(backend=backend),
        **extra,
    )
    policy, policy_batch, scorers, scorer_batch = rollout
    engine = flowrl.RLHFEngine(
        Policy("policy", {"num_replicas": policy, "batch_size": policy_batch, **gpu}),
        Reference("reference", {"num_replicas": scorers, "batch_size": scorer_batch, **gpu}),
        Reward("reward", {"num_replicas": 2, "batch_size": 16, **cpu}),
        Value("value", {"num_replicas": scorers, "batch_size": scorer_batch, **gpu}),
        PPOPolicy("ppo_policy", {"num_replicas": trainer_ranks, **gpu}),
        PPOValue("ppo_value", {"num_replicas": 1, **gpu}),
        config,
    )
    engine.set_dataset(dataset())
    return engine


def dataset() -> list[dict[str, int]]:
    """Every prompt token, 16 times over."""
    return [{"prompt": p} for p in range(VOCAB)] * 16


def reward_curve(stats: flowrl.EngineStats, trainer: str = "ppo_policy") -> list[float]:
    return [e.metrics[trainer]["reward"] for e in stats.episodes]


def tensorboard(folder: str | None) -> list[Any]:
    """``RunConfig.loggers`` for ``--tensorboard FOLDER``: the scalars of every episode go there."""
    return [{"kind": "tensorboard", "dir": folder}] if folder else []


def add_tracking_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tensorboard",
        metavar="FOLDER",
        help="write each episode's scalars (reward, losses, phase times, busy fractions) as TensorBoard "
        "event files into FOLDER; then run: tensorboard --logdir FOLDER (needs: pip install tensorboard)",
    )


def print_curve(curve: list[float]) -> tuple[float, float]:
    """Print the curve as bars; the mean reward of the first and of the last 3 episodes."""
    for e, score in enumerate(curve):
        print(f"episode {e:3d}  mean reward {score:.3f}  {'#' * round(score * 40)}")
    k = min(3, len(curve))
    first, last = sum(curve[:k]) / k, sum(curve[-k:]) / k
    print(f"\nmean reward: first {k} episodes {first:.3f}, last {k} episodes {last:.3f}")
    return first, last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="PPO on a toy counting task with six tiny models")
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--backend", choices=["ray", "inprocess"], default="ray")
    parser.add_argument("--plot", help="write the reward curve to this PNG (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0, help="RunConfig.seed: the same seed gives the same run")
    add_tracking_flag(parser)
    args = parser.parse_args(argv)
    # NCCL takes one rank per GPU, and fractional replicas share GPU 0: one trainer rank on GPUs
    ranks = 2 if args.backend == "ray" and not on_gpu(args.backend) else 1
    if on_gpu(args.backend):
        print(f"on {torch.cuda.get_device_name(0)}: policy, reference, value and trainers compute on cuda")
    stats = make_engine(args.episodes, args.backend, ranks, tensorboard(args.tensorboard), args.seed).learn()
    curve = reward_curve(stats)
    first, last = print_curve(curve)
    if args.tensorboard:
        print(f"TensorBoard: tensorboard --logdir {args.tensorboard}  (the reward: train/ppo_policy/reward)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plt.plot(curve)
        plt.xlabel("episode")
        plt.ylabel("mean reward")
        plt.title("ppo_tiny")
        plt.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")
    # Exit status 1 when the reward did not rise: a check for runs long enough to learn (a few
    # episodes, e.g. a smoke run of 2, only show that everything runs).
    return 0 if last > first + 0.2 or args.episodes < 10 else 1


if __name__ == "__main__":
    sys.exit(main())
