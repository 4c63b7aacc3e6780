"""The seed's six-model PPO flow with real language models, synchronous against asynchronous
(issue 25; docs/gpu.md).

ChatLearn #209's layout as a whole RLHF run: ``RLHFEngine`` over ``flowrl.hf`` models of a real
architecture (random weights, ``--arch``): ``--policy-replicas`` (2) policy replicas in batches
of ``--policy-batch`` (64) feed ``--scorer-replicas`` (8) replicas each of a reference, a value
and a reward model in batches of ``--scorer-batch`` (32); a PPO trainer and a value trainer, one
rank per GPU (FSDP2 over the ranks when there are several), send their weights to the policy and
the value by CUDA IPC on one GPU and by NCCL on several. All six models are colocated on every
GPU (``RunConfig.colocation``), as ChatLearn colocates them. Responses end at long-tailed
lengths (hf_lengths.LengthPolicy forces eos at each sample's target).

Each ``--modes`` entry is one engine run of ``--episodes`` episodes on the same models and data:
``sync`` (``staleness.max`` 0) and ``async`` (``staleness.max`` 1). Per mode, over the episodes
after the first (CUDA's warm-up): seconds per episode (the run's wall time over its episodes),
per phase (rollout, generation, each scorer, each trainer, weight sync) the median seconds, the
rollout's generated tokens/s, each model's replicas used per episode, each GPU's
utilization by nvidia-smi (median and mean), and the GPU memory of the run's processes by
nvidia-smi (each process's peak and the peak of their sum, sampled every 0.5 s). A mode that
fails (out of GPU memory, say) is recorded with its error and that memory, the next mode still
runs, and the script exits 1 after writing the record.

``--empty-cache on`` sets both trainers' ``Train.empty_cache``: each hands its allocator's unused
blocks back to the GPU after a step, for the rollout's replicas sharing it (off by default, as in
the runs docs/gpu.md reports for SmolLM2-135M). Qwen2.5-0.5B fits on one GPU with it and
``--micro-batch-tokens 2048``; at the default 8,192 its value step ran out of memory (docs/gpu.md).
``--gradient-checkpointing on`` sets their ``Train.gradient_checkpointing`` (off by default): less
live memory a step, for a recomputed forward pass.

    python3 benchmarks/gpu/seed_ppo.py --arch smollm2-135m --out OUT     # on the GPU machine
    python3 benchmarks/gpu/seed_ppo.py --arch qwen2.5-0.5b --engine vllm --out OUT   # the policy on vLLM
    python benchmarks/gpu/seed_ppo.py --tiny --episodes 2 --samples 16 --n 2 --tokens 8 \\
        --policy-batch 8 --scorer-batch 4 --scorer-replicas 2 --out /tmp/seed-ppo   # a CPU check

Writes OUT/seed-ppo.md (the command line, then the tables) and OUT/seed-ppo.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_lengths  # noqa: E402
from gpt import covered  # noqa: E402
from hf_grpo import ARCHS, GpuBusy  # noqa: E402
from hf_lengths import TINY, LengthPolicy, make_prompts  # noqa: E402
from seed_layout import begin, layout_arguments  # noqa: E402

import flowrl  # noqa: E402
from flowrl import hf  # noqa: E402

ROLLOUT = ("policy", "reference", "value", "reward")
TRAINERS = ("ppo_policy", "ppo_value")
MODES = {"sync": 0, "async": 1}  # RunConfig.staleness.max


def build(args: argparse.Namespace, gpus: int, tokenizer: str) -> list[flowrl.Model]:
    """The six models in RLHFEngine's order; on a GPU each model's replicas fill every GPU."""
    arch = TINY if args.tiny else ARCHS[args.arch]
    lm = hf.LM(config=arch, tokenizer=tokenizer, dtype="bfloat16" if gpus else "float32")
    ranks = max(1, gpus)
    counts = {"policy": args.policy_replicas, "trainer": ranks} | dict.fromkeys(ROLLOUT[1:], args.scorer_replicas)

    def config(role: str, batch: int = 0) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_replicas": counts[role],
            "cpus_per_replica": 0.5,
            "call_timeout_s": args.step_timeout,
        }
        if batch:
            out["batch_size"] = batch
        if gpus:
            out["gpus_per_replica"] = min(1.0, gpus / counts[role])
        return out

    transport = {"weight_transport": "cuda_ipc" if gpus == 1 else "nccl" if gpus else "host"}
    sampling = {"max_new_tokens": args.tokens, "temperature": 1.0, "chat_template": False}
    ppo: dict[str, Any] = {"kl_coef": 0.05}
    optim = {"lr": 1e-6}
    train = {"micro_batch_tokens": args.micro_batch_tokens} | switches(args)
    trainer_lm = hf.LM(config=arch, tokenizer=tokenizer)  # fp32 weights, bf16 autocast on a GPU
    if args.engine == "vllm":  # the trainer recomputes its log-probs, TIS against the engine's
        from vllm_lengths import VLLMLengthPolicy

        engine: dict[str, Any] = {"gpu_memory_utilization": args.vllm_memory, "sleep": args.vllm_sleep}
        if args.vllm_kv_gib:  # a fixed KV cache: vLLM's profile of free memory is wrong while other replicas load
            engine["engine_args"] = {"kv_cache_memory_bytes": int(args.vllm_kv_gib * 2**30)}
        policy: flowrl.Model = VLLMLengthPolicy(
            "policy", config("policy", args.policy_batch), lm=lm, sampling=sampling, engine=engine
        )
        ppo |= {"old_logprobs": "recompute", "tis_cap": 2.0}
    else:
        policy = LengthPolicy("policy", config("policy", args.policy_batch), lm=lm, sampling=sampling)
    return [
        policy,
        hf.HFReference("reference", config("reference", args.scorer_batch), lm=lm),
        hf.HFRewardModel("reward", config("reward", args.scorer_batch), lm=lm),
        hf.HFValue("value", config("value", args.scorer_batch), lm=lm),
        hf.PPOTrainer("ppo_policy", config("trainer") | transport, lm=trainer_lm, ppo=ppo, optim=optim, train=train),
        hf.ValueTrainer("ppo_value", config("trainer") | transport, lm=trainer_lm, ppo=ppo, optim=optim, train=train),
    ]


def switches(args: argparse.Namespace) -> dict[str, bool]:
    """The trainers' memory switches: ``Train.empty_cache`` (``--empty-cache``) and
    ``Train.gradient_checkpointing`` (``--gradient-checkpointing``)."""
    return {"empty_cache": args.empty_cache == "on", "gradient_checkpointing": args.gradient_checkpointing == "on"}


class GpuMemory:
    """The GPU memory of every process by nvidia-smi, polled every ``every`` seconds: each
    process's peak MiB and the peak of their sum (what the GPU held for all of them at once)."""

    def __init__(self, every: float = 0.5) -> None:
        self.every, self.total_peak_mib, self.polls = every, 0.0, 0
        self.peak: dict[str, float] = {}  # pid: MiB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while not self._stop.wait(self.every):
            try:
                lines = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.splitlines()
            except (OSError, subprocess.SubprocessError):
                continue
            now: dict[str, float] = {}
            for line in lines:
                parts = [x.strip() for x in line.split(",")]
                if len(parts) == 2 and parts[1].replace(".", "", 1).isdigit():
                    now[parts[0]] = float(parts[1])
            self.polls += 1
            for pid, mib in now.items():
                self.peak[pid] = max(mib, self.peak.get(pid, 0.0))
            self.total_peak_mib = max(self.total_peak_mib, sum(now.values()))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=15)
        per = sorted(self.peak.values(), reverse=True)
        return {"total_peak_gib": self.total_peak_mib / 1024, "peak_gib": [p / 1024 for p in per], "polls": self.polls}


def run_mode(
    args: argparse.Namespace, mode: str, gpus: int, tokenizer: str, data: list[dict[str, Any]]
) -> dict[str, Any]:
    models = build(args, gpus, tokenizer)
    config = {
        "sample_per_episode": args.samples,
        "num_episode": args.episodes,
        "train_global_batch_size": args.samples // args.steps,
        "staleness": {"max": MODES[mode]},
        "seed": args.seed,
        "progress": "off",
        "colocation": [[m.name for m in models]] if gpus else [],
        "pipeline": {"backend": "ray"},
    }
    engine = flowrl.RLHFEngine(*models, config)
    engine.set_dataset(data)
    sampler = GpuBusy() if gpus else None
    memory = GpuMemory() if gpus else None
    failed = None
    try:
        with engine:
            stats = engine.learn()
            spans = engine.spans()
    except flowrl.FlowError as err:  # out of GPU memory, say: what the GPU held still tells why
        failed = f"{type(err).__name__}: {err}"
    finally:
        util = sampler.stop() if sampler is not None else {}
        held = memory.stop() if memory is not None else {}
    done = {"memory": held} | switches(args)
    if failed is not None:
        return done | {"error": failed[:4000], "gpu_busy_run": util}
    return summarize(spans, stats, data, sampler, util) | done


def summarize(
    spans: list[Any],
    stats: flowrl.EngineStats,
    data: list[dict[str, Any]],
    sampler: GpuBusy | None,
    util: dict[str, float],
) -> dict[str, Any]:
    """Per episode: each phase's seconds, each model's busy seconds inside the episode's rollout
    (generation is the policy's), and its replicas used; the measured window (episodes 1..)."""
    phase = {(s.name, s.args.get("episode")): s for s in spans if s.group == "engine" and "episode" in s.args}
    episodes = sorted({e for _, e in phase})
    rows = []
    for e in episodes:
        roll = phase.get(("rollout", e))
        row: dict[str, Any] = {"episode": e}
        for name in ("rollout", "train"):
            if (name, e) in phase:
                row[name] = phase[(name, e)].end - phase[(name, e)].start
        # the engine's own figure: an asynchronous sync's span also waits for the rollout in flight
        row["sync"], row["wait"] = next((x.sync_s, x.wait_s) for x in stats.episodes if x.episode == e)
        if roll is not None:
            for m in ROLLOUT:
                mine = [s for s in spans if s.group == m and roll.start <= s.start < roll.end]
                row[f"{m} busy"] = covered([(s.start, s.end) for s in mine], roll.start, roll.end)
                row[f"{m} replicas"] = len({s.lane for s in mine})
                # each call: replica, start and end from the rollout's start, samples
                row[f"{m} calls"] = [
                    (s.lane, s.start - roll.start, s.end - roll.start, len(s.args.get("ids", ()))) for s in mine
                ]
        for t in TRAINERS:
            row[f"{t} busy"] = covered(
                [(s.start, s.end) for s in spans if s.group == t and s.args.get("episode") == e], 0, 1e12
            )
        rows.append(row)
    measured = [phase[(n, e)] for n, e in phase if e >= 1]
    window = (min(s.start for s in measured), max(s.end for s in measured)) if measured else (0.0, 0.0)
    out: dict[str, Any] = {"episodes": rows, "window": window, "tokens": sum(int(d["target"]) for d in data)}
    out["stats"] = [
        {k: getattr(e, k) for k in ("episode", "rollout_s", "train_s", "sync_s", "wait_s")} for e in stats.episodes
    ]
    out["staleness"] = [e.staleness for e in stats.episodes]
    if sampler is not None:
        out["gpu_busy"] = sampler.per_gpu([window])
        out["gpu_busy_run"] = util
    return out


def markdown(record: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"`{record['command']}`",
        "",
        f"{args.samples} samples an episode, responses of at most {args.tokens} tokens ({record['tokens']} in all); "
        f"policy {args.policy_replicas} x batch {args.policy_batch}, reference / value / reward {args.scorer_replicas} "
        f"x batch {args.scorer_batch} each, trainers {record['ranks']} rank(s), weights by {record['transport']}; "
        f"{record['gpus']} GPU(s); medians of episodes 1..{args.episodes - 1} (episode 0 warms up); "
        "trainers' Train: " + ", ".join(f"{key} {value}" for key, value in switches(args).items()),
        "",
        "| mode | s / episode | rollout s | generation s | reference / value / reward busy s "
        "| ppo_policy / ppo_value s | sync s | training waited s | tokens/s (rollout) "
        "| replicas used (policy / reference / value / reward) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, rec in record["modes"].items():
        rows = [r for r in rec.get("episodes", []) if r["episode"] >= 1]
        if not rows:
            continue

        def med(key: str, rows: list[dict[str, Any]] = rows) -> float:
            values = [r[key] for r in rows if key in r]
            return statistics.median(values) if values else float("nan")

        per = (rec["window"][1] - rec["window"][0]) / len(rows)
        used = " / ".join(str(max(r.get(m + " replicas", 0) for r in rows)) for m in ROLLOUT)
        scorers = " / ".join(f"{med(m + ' busy'):.2f}" for m in ROLLOUT[1:])
        trainers = " / ".join(f"{med(t + ' busy'):.2f}" for t in TRAINERS)
        lines.append(
            f"| {mode} | {per:.2f} | {med('rollout'):.2f} | {med('policy busy'):.2f} | {scorers} | {trainers} | "
            f"{med('sync'):.3f} | {med('wait'):.2f} | {record['tokens'] / med('rollout'):.0f} | {used} |"
        )
    if all("window" in record["modes"].get(m, {}) for m in ("sync", "async")):
        per = {m: (r["window"][1] - r["window"][0]) for m, r in record["modes"].items()}
        lines += ["", f"async / sync wall time of the measured episodes: {per['async'] / per['sync']:.2f}"]
    for mode, rec in record["modes"].items():
        if "error" in rec:
            lines.append(f"\n{mode} failed: {rec['error'].splitlines()[0][:300]}")
        cells = ", ".join(f"GPU {i}: {v['median']:.0f}% / {v['mean']:.0f}%" for i, v in rec.get("gpu_busy", {}).items())
        if cells:
            lines.append(f"\nGPU busy during {mode}'s measured episodes (nvidia-smi, median / mean): {cells}")
        held = rec.get("memory", {})
        if held.get("polls"):
            top = ", ".join(f"{g:.1f}" for g in held["peak_gib"][:6])
            lines.append(
                f"\nGPU memory during {mode} (nvidia-smi): the processes' sum peaked at "
                f"{held['total_peak_gib']:.1f} GiB; the largest processes' peaks {top} GiB "
                f"(of {len(held['peak_gib'])} processes)"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() and not args.tiny else 0
    out, arch, tokenizer = begin(args)
    texts, targets = make_prompts(args, arch["vocab_size"])
    rng = np.random.default_rng(args.seed)
    data = hf_lengths.epoch_items(args, texts, targets, rng)  # the same samples every episode
    record: dict[str, Any] = {"command": shlex.join(sys.argv), "gpus": gpus, "ranks": max(1, gpus)}
    record |= {"transport": "CUDA IPC" if gpus == 1 else "NCCL" if gpus else "host memory", "tokens": 0, "modes": {}}
    for mode in args.modes.split(","):
        started = time.time()
        rec = run_mode(args, mode, gpus, tokenizer, data)
        record["tokens"] = rec.get("tokens", record["tokens"])
        record["modes"][mode] = rec
        print(f"{mode}: {time.time() - started:.1f} s (start-up included)", flush=True)
        (out / "seed-ppo.json").write_text(json.dumps(record, indent=1))  # what ran, should a later mode fail
    (out / "seed-ppo.md").write_text(markdown(record, args))
    print(markdown(record, args))
    if any("error" in rec for rec in record["modes"].values()):
        sys.exit(1)  # after the record: a failed mode's error and GPU memory are in it


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    layout_arguments(p, "/tmp/flowrl-seed-ppo")
    p.add_argument("--modes", default="sync,async", help="comma-separated: sync (staleness.max 0), async (1)")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="the policy samples with generate or vLLM")
    p.add_argument("--vllm-memory", type=float, default=0.1, help="each engine's VLLMConfig.gpu_memory_utilization")
    p.add_argument("--vllm-kv-gib", type=float, default=0.0, help="each engine's KV cache in GiB (0: vLLM's profile)")
    p.add_argument("--vllm-sleep", type=int, choices=(0, 1, 2), default=0, help="each engine's VLLMConfig.sleep")
    p.add_argument("--episodes", type=int, default=4, help="per mode; the first warms up")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps an episode (per trainer)")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument(
        "--empty-cache",
        choices=("on", "off"),
        default="off",
        help="the trainers' Train.empty_cache: release the allocator's cache after each step",
    )
    p.add_argument(
        "--gradient-checkpointing",
        choices=("on", "off"),
        default="off",
        help="the trainers' Train.gradient_checkpointing: recompute activations in the backward pass",
    )
    args = p.parse_args()
    if args.samples % args.n or args.samples % args.steps or args.tokens < 2:
        p.error(
            f"--samples ({args.samples}) must be a multiple of --n ({args.n}) and of --steps ({args.steps}), "
            f"and --tokens ({args.tokens}) at least 2"
        )
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        p.error(f"--modes: unknown {sorted(unknown)}; choose among {sorted(MODES)}")
    return args


if __name__ == "__main__":
    ray.cloudpickle.register_pickle_by_value(hf_lengths)  # the replicas lack this folder on their path
    main()
