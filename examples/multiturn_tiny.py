"""Multi-turn GRPO on the counting task of ppo_tiny.py: one token a turn, until a wrong one.

The prompt is one token p of a vocabulary of 8. Each turn the policy (stage ``policy.act``)
writes ONE token, given the previous token (the prompt, or the response's last token) and the
turn's position, and appends it and its sampling log-prob to the sample's state
(``response``, ``logps``). An environment (stage ``env.step``, a plain model without weights)
checks the newest token: correct if it is the previous one + 1 (mod 8). The game ends on the
first wrong token or after 4 tokens, so samples take 1 to 4 turns: a ``flowrl.loop``. Its
reward (``score``) is the number of correct tokens / 4; a random policy scores about 0.04 and
plays about 1.14 turns. After the loop a frozen reference scores the whole response for the
KL penalty, and a GRPO trainer (4 copies of each prompt, responses padded to 4 tokens under a
mask) raises the reward and, with it, the turns a game lasts.

    python examples/multiturn_tiny.py                        # Ray backend
    python examples/multiturn_tiny.py --backend inprocess    # everything in this process
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import grpo_tiny
import ppo_tiny
import torch
from ppo_tiny import CLIP, KL_COEF, LENGTH, SEED, VOCAB, TinyLM, build, logprobs, mean_score

import flowrl
from flowrl.rl import sample_rows


def padded(rows: list[list[Any]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-sample lists as an [n, LENGTH] tensor (zeros after each row) and its mask."""
    out = torch.zeros(len(rows), LENGTH, dtype=dtype)
    mask = torch.zeros(len(rows), LENGTH)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(list(row), dtype=dtype)
        mask[i, : len(row)] = 1.0
    return out, mask


class Policy(ppo_tiny.Policy):
    """ppo_tiny's sampling policy (same weights, per-sample streams), one token a turn."""

    @flowrl.step
    @torch.no_grad()
    def act(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        responses, logps = batch["response"], batch["logps"]
        prompts = torch.as_tensor(batch["prompt"]).long().tolist()
        previous = torch.tensor([r[-1] if len(r) else p for r, p in zip(responses, prompts, strict=True)])
        position = torch.tensor([len(r) for r in responses])
        logits = self.module.head(
            self.module.token(previous.to(self.device)) + self.module.position(position.to(self.device))
        )
        logp = torch.log_softmax(logits, -1)
        token = sample_rows(logp.exp(), batch.generators(self.device)).unsqueeze(-1)  # streams per sample and turn
        chosen = logp.gather(-1, token).squeeze(-1).cpu().tolist()
        token = token.squeeze(-1).cpu().tolist()
        return {
            "response": [list(r) + [t] for r, t in zip(responses, token, strict=True)],
            "logps": [list(lp) + [x] for lp, x in zip(logps, chosen, strict=True)],
        }


class Env(flowrl.Model):
    """Checks the newest token: the game is over on a wrong one or after LENGTH tokens."""

    @flowrl.step
    def step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        done, score = [], []
        for p, r in zip(torch.as_tensor(batch["prompt"]).tolist(), batch["response"], strict=True):
            previous = r[-2] if len(r) > 1 else p
            correct = r[-1] == (previous + 1) % VOCAB
            done.append(not correct or len(r) >= LENGTH)
            score.append((len(r) - (not correct)) / LENGTH)  # every earlier token was correct
        return {"done": done, "score": torch.tensor(score)}


class Reference(flowrl.Model):
    """Frozen initial weights: log-probs of each whole (ragged) response, for the KL penalty."""

    def setup(self) -> None:
        self.module = build(TinyLM).to(self.device).eval()

    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        response, _ = padded(batch["response"], torch.long)
        prompt = torch.as_tensor(batch["prompt"]).long()
        ref = logprobs(self.module, prompt.to(self.device), response.to(self.device)).cpu().tolist()
        return {"ref_logps": [row[: len(r)] for row, r in zip(ref, batch["response"], strict=True)]}


class MultiTurnGRPO(grpo_tiny.GRPOPolicy):
    """grpo_tiny's trainer (group-relative advantages, clipped ratio, KL to the reference), on
    responses of 1 to LENGTH tokens: padded to LENGTH, the padding masked out of the loss."""

    def step(self, batch: flowrl.Batch) -> float:
        self.optimizer.zero_grad()
        total, tokens = 0.0, 0.0
        for mb in self.micro_batches(batch):
            response, mask = padded(mb["response"], torch.long)
            old, _ = padded(mb["logps"], torch.float)
            ref, _ = padded(mb["ref_logps"], torch.float)
            prompt = torch.as_tensor(mb["prompt"]).long()
            adv = torch.as_tensor(mb["advantage"]).float()[:, None]
            prompt, response, mask, old, ref, adv = (t.to(self.device) for t in (prompt, response, mask, old, ref, adv))
            new = logprobs(self.module, prompt, response)
            ratio = torch.exp(new - old)
            clipped = -torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
            loss = ((clipped + KL_COEF * (new - ref)) * mask).sum()
            (loss / (self.global_batch_size * LENGTH)).backward()  # a constant divisor: exact over ranks
            total += float(loss.detach())
            tokens += float(mask.sum())
        self.all_reduce_grads(self.module)
        self.optimizer.step()
        return total / max(1.0, tokens)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, float]:
        loss = self.step(self._with_advantages(batch))
        turns = float(torch.as_tensor(batch["game_turns"]).float().mean()) if len(batch) else 0.0
        return {"policy_loss": loss, "reward": mean_score(batch), "turns": turns}


def make_engine(episodes: int, backend: str = "ray", group: int = 4) -> flowrl.Engine:
    cpu = {"cpus_per_replica": 0.25}
    policy = Policy("policy", {"num_replicas": 2, "batch_size": 16, **cpu})
    env = Env("env", {"num_replicas": 1, "batch_size": 32, **cpu})
    reference = Reference("reference", {"num_replicas": 1, "batch_size": 32, **cpu})
    trainer = MultiTurnGRPO("grpo_policy", {"num_replicas": 2 if backend == "ray" else 1, **cpu})

    def rollout(prompts: Any) -> Any:
        game = flowrl.loop(lambda s: env.step(policy.act(s)), prompts, until="done", max_turns=LENGTH, name="game")
        return reference.forward_step(game)

    config = grpo_tiny.run_config(episodes, backend, group, seed=SEED)
    engine = flowrl.Engine(rollout=rollout, train=[trainer], sync=[(trainer, policy)], config=config)
    engine.set_dataset(dataset())
    return engine


def dataset() -> list[dict[str, Any]]:
    """Every prompt token, 16 times over, with the game's initial state."""
    return [{"prompt": p, "response": [], "logps": []} for p in range(VOCAB)] * 16


def reward_curve(stats: flowrl.EngineStats) -> list[float]:
    return ppo_tiny.reward_curve(stats, "grpo_policy")


def turns_curve(stats: flowrl.EngineStats) -> list[float]:
    """Mean turns a game took, per episode (over the samples trained on)."""
    return [e.metrics["grpo_policy"]["turns"] for e in stats.episodes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="multi-turn GRPO on a toy counting game")
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--backend", choices=["ray", "inprocess"], default="ray")
    args = parser.parse_args(argv)
    stats = make_engine(args.episodes, args.backend).learn()
    first, last = ppo_tiny.print_curve(reward_curve(stats))
    turns = turns_curve(stats)
    print("mean turns per episode: " + " ".join(f"{t:.2f}" for t in turns))
    print(f"mean turns: first episode {turns[0]:.2f}, last episode {turns[-1]:.2f}")
    if stats.rollout is not None and "game" in stats.rollout.loops:
        game = stats.rollout.loops["game"]
        print(f"all games: {game.samples} samples, {game.turns} turns, turns -> samples {game.turn_counts}")
    # Exit status 1 when the reward did not rise: a check for runs long enough to learn (a few
    # episodes, e.g. a smoke run of 2, only show that everything runs).
    return 0 if last > first + 0.2 or args.episodes < 10 else 1


if __name__ == "__main__":
    sys.exit(main())
