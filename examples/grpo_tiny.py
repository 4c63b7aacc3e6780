"""GRPO on the toy counting task of ppo_tiny.py: group-relative advantages, no value model.

Each prompt is answered 4 times (a group); a response's advantage is its reward minus the
mean reward of its group, over the group's standard deviation. flowrl keeps each group's
copies together (same global batch, same rank), so the trainer can compute it locally.

    python examples/grpo_tiny.py
    python examples/grpo_tiny.py --tensorboard runs/grpo_tiny     # then: tensorboard --logdir runs/grpo_tiny
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import ppo_tiny
import torch
from ppo_tiny import CLIP, KL_COEF, VOCAB, Policy, Reference, Reward, Trainer, logprobs, mean_score

import flowrl


class GRPOPolicy(Trainer):
    fields = ("prompt", "response", "old_logprobs", "ref_logprobs", "advantage")

    def loss(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        new = logprobs(self.module, mb["prompt"].long(), mb["response"])
        ratio = torch.exp(new - mb["old_logprobs"])
        adv = mb["advantage"][:, None]
        clipped = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
        return (clipped + KL_COEF * (new - mb["ref_logprobs"])).sum()

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, float]:
        loss = self.step(self._with_advantages(batch))
        return {"policy_loss": loss, "reward": mean_score(batch)}

    def _with_advantages(self, batch: flowrl.Batch) -> flowrl.Batch:
        score = batch["score"]
        prompts = list(batch["prompt_index"]) if len(batch) else []
        adv = torch.zeros_like(score)
        start = 0
        for end in range(1, len(prompts) + 1):  # a group: a run of copies of one prompt, all here
            if end == len(prompts) or prompts[end] != prompts[start]:
                group = score[start:end]
                adv[start:end] = (group - group.mean()) / (group.std() + 1e-6) if end - start > 1 else 0.0
                start = end
        out = batch.select(range(len(batch)))
        out["advantage"] = adv
        return out


def make_engine(
    episodes: int,
    backend: str = "ray",
    group: int = 4,
    loggers: list[Any] | None = None,
    seed: int = 0,
    rollout_layout: tuple[int, int, int, int] = (2, 16, 1, 32),
    **extra: Any,
) -> flowrl.Engine:
    """``rollout_layout``: (policy replicas, their shard size, reference replicas, theirs);
    ``extra``: more ``RunConfig`` keys."""
    cpu = {"cpus_per_replica": 0.25}
    policies, policy_batch, references, reference_batch = rollout_layout
    policy = Policy("policy", {"num_replicas": policies, "batch_size": policy_batch, **cpu})
    reference = Reference("reference", {"num_replicas": references, "batch_size": reference_batch, **cpu})
    reward = Reward("reward", {"num_replicas": 2, "batch_size": 16, **cpu})
    trainer = GRPOPolicy("grpo_policy", {"num_replicas": 2 if backend == "ray" else 1, **cpu})

    def rollout(prompts: Any) -> Any:
        out = policy.forward_step(prompts)
        return reward.forward_step(out, reference.forward_step(out))

    config = run_config(episodes, backend, group, loggers=loggers or [], seed=seed, **extra)
    engine = flowrl.Engine(rollout=rollout, train=[trainer], sync=[(trainer, policy)], config=config)
    engine.set_dataset([{"prompt": p} for p in range(VOCAB)] * 16)
    return engine


def run_config(episodes: int, backend: str, group: int, **extra: Any) -> flowrl.RunConfig:
    """64 samples an episode in groups of ``group``, four epochs over global batches of 32."""
    return flowrl.RunConfig(
        sample_per_episode=64,
        num_episode=episodes,
        num_samples_per_prompt=group,
        train_global_batch_size=32,
        train_micro_batch_size=16,
        num_training_epoch=4,
        shuffle=True,
        pipeline=flowrl.PipelineConfig(backend=backend),
        **extra,
    )


def reward_curve(stats: flowrl.EngineStats) -> list[float]:
    return ppo_tiny.reward_curve(stats, "grpo_policy")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GRPO on a toy counting task")
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--backend", choices=["ray", "inprocess"], default="ray")
    parser.add_argument("--seed", type=int, default=0, help="RunConfig.seed: the same seed gives the same run")
    ppo_tiny.add_tracking_flag(parser)
    args = parser.parse_args(argv)
    engine = make_engine(args.episodes, args.backend, loggers=ppo_tiny.tensorboard(args.tensorboard), seed=args.seed)
    first, last = ppo_tiny.print_curve(reward_curve(engine.learn()))
    if args.tensorboard:
        print(f"TensorBoard: tensorboard --logdir {args.tensorboard}  (the reward: train/grpo_policy/reward)")
    # Exit status 1 when the reward did not rise: a check for runs long enough to learn (a few
    # episodes, e.g. a smoke run of 2, only show that everything runs).
    return 0 if last > first + 0.2 or args.episodes < 10 else 1


if __name__ == "__main__":
    sys.exit(main())
