"""ChatLearn #209's layout with real language models, pull against static push (issue 25;
docs/gpu.md).

The seed's shape: ``--policy-replicas`` (2) policy replicas in batches of ``--policy-batch``
(64) feed ``--scorer-replicas`` (8) replicas each of a reference, a value and a reward model in
batches of ``--scorer-batch`` (32), so upstream emits fewer batches than downstream has
replicas. Every model is a ``flowrl.hf`` model of a real architecture with random weights
(``--arch``), all colocated on the machine's GPUs by fractional shares; both systems' replicas
are alive at once, so each holds half of every GPU. Responses end at long-tailed lengths (the
policy of hf_lengths.py forces eos at each sample's target). Episode by episode, in turns:

- pull: a flowrl pipeline (policy -> reference and value -> reward), shards cut on demand;
- push: ChatLearn's static push (pull_push.py): policy batch ``i`` whole to replica ``i mod n``
  of every model.

Per system (medians over the episodes after the first, which warms up): rollout seconds,
tokens/s, each model's replicas used and busy seconds, idle GPU-seconds (each replica's GPU
share times the time it spent outside a step), and each GPU's utilization by nvidia-smi (median
and mean over the system's episodes).

    python3 benchmarks/gpu/seed_layout.py --out OUT          # on the GPU machine
    python benchmarks/gpu/seed_layout.py --tiny --episodes 2 --samples 32 --tokens 16 \\
        --policy-batch 16 --scorer-batch 8 --out /tmp/seed   # a CPU check

Writes OUT/seed-layout.md (the command line, then the tables) and OUT/seed-layout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_lengths  # noqa: E402
import pull_push  # noqa: E402
from hf_grpo import ARCHS, GpuBusy  # noqa: E402
from hf_lengths import TINY, LengthPolicy, epoch_items, make_prompts, make_tokenizer  # noqa: E402

import flowrl  # noqa: E402
from flowrl import hf  # noqa: E402
from flowrl._sim.push import simulate_push  # noqa: E402

ROLES = list(pull_push.ROLES)  # policy, reference, value, reward
SYSTEMS = ("pull", "push")


def build(args: argparse.Namespace, on_gpu: bool, tokenizer: str) -> tuple[dict[str, flowrl.Model], dict[str, float]]:
    """The four models, and each one's GPU share per replica (0 on the CPU)."""
    arch = TINY if args.tiny else ARCHS[args.arch]
    lm = hf.LM(config=arch, tokenizer=tokenizer, dtype="bfloat16" if on_gpu else "float32")
    counts = {m: args.policy_replicas if m == "policy" else args.scorer_replicas for m in ROLES}
    gpus = torch.cuda.device_count() if on_gpu else 0
    share = min(1.0, 0.5 * gpus / sum(counts.values()))  # half of every GPU for each system

    def config(m: str) -> dict[str, Any]:
        return {
            "num_replicas": counts[m],
            "batch_size": args.policy_batch if m == "policy" else args.scorer_batch,
            "cpus_per_replica": 0.5,
            "call_timeout_s": args.step_timeout,
            **({"gpus_per_replica": share} if on_gpu else {}),
        }

    sampling = {"max_new_tokens": args.tokens, "temperature": 1.0, "chat_template": False}
    models: dict[str, flowrl.Model] = {
        "policy": LengthPolicy("policy", config("policy"), lm=lm, sampling=sampling),
        "reference": hf.HFReference("reference", config("reference"), lm=lm),
        "value": hf.HFValue("value", config("value"), lm=lm),
        "reward": hf.HFRewardModel("reward", config("reward"), lm=lm),
    }
    return models, dict.fromkeys(ROLES, share)


def episode_metrics(
    spans: list[pull_push.Span], start: float, end: float, models: dict[str, flowrl.Model], share: dict[str, float]
) -> dict[str, Any]:
    out: dict[str, Any] = pull_push.measure(spans, start, end, ROLES)
    busy: dict[tuple[str, int], float] = {}
    for name, replica, a, b in spans:
        busy[(name, replica)] = busy.get((name, replica), 0.0) + min(b, end) - max(a, start)
    out["replicas used"] = {m: len({r for name, r in busy if name == m}) for m in ROLES}
    out["idle GPU-s"] = sum(
        share[m] * (out["s"] - busy.get((m, r), 0.0)) for m in ROLES for r in range(models[m].config.replicas)
    )
    return out


def shard_calls(spans: list[Any], items: list[dict[str, Any]]) -> list[tuple[str, int, int, float]]:
    """Each pull call of the episode: (model, samples, its longest target, seconds)."""
    first = min(i for s in spans for i in s.args.get("ids", ()))  # a run's ids are consecutive
    return [
        (s.group, len(s.args["ids"]), max(int(items[i - first]["target"]) for i in s.args["ids"]), s.end - s.start)
        for s in spans
        if s.args.get("ids")
    ]


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed, slope) of seconds against ``x`` by least squares; through 0 if ``x`` never varies."""
    x, y = np.array([p[0] for p in points], dtype=float), np.array([p[1] for p in points])
    if len(set(x.tolist())) < 2:
        return 0.0, float(np.mean(y / np.maximum(x, 1)))
    slope, fixed = np.polyfit(x, y, 1)
    return max(0.0, float(fixed)), max(0.0, float(slope))


def predict(episodes: list[dict[str, Any]], models: dict[str, flowrl.Model]) -> list[dict[str, float]]:
    """The simulator's makespans of each measured episode, pull and static push, from stage costs
    fitted on every measured pull call: a scorer's call ``fixed + per * samples``, the policy's
    ``fixed + per_token * its longest target`` (a generation runs until its longest row ends)."""
    calls = [c for e in episodes for c in e["calls"]]
    if not calls:
        return []
    costs = {}
    for m in ROLES:
        x = [(float(t) if m == "policy" else float(n), d) for name, n, t, d in calls if name == m]
        costs[m] = fit(x)
    stages = [
        flowrl.SimStage(
            name=m,
            inputs=["input"] if m == "policy" else ["policy", "reference", "value"] if m == "reward" else ["policy"],
            replicas=models[m].config.replicas,
            batch_size=models[m].config.batch_size,
            cost=flowrl.StageCost(call_s=costs[m][0], per_sample_s=0.0 if m == "policy" else costs[m][1]),
        )
        for m in ROLES
    ]
    out = []
    for e in episodes:
        tail = [costs["policy"][1] * t for t in e["targets"]]
        w = flowrl.Workload(stages=stages, samples=len(tail), tail_s={"policy": tail})
        out.append({"pull": flowrl.simulate(w).makespan_s, "push": simulate_push(w).makespan_s})
    return out


def begin(args: argparse.Namespace) -> tuple[Path, dict[str, Any], str]:
    """The output folder (made), the architecture, a tokenizer folder; Ray started."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arch = TINY if args.tiny else ARCHS[args.arch]
    tokenizer = args.tokenizer or make_tokenizer(Path(tempfile.mkdtemp(prefix="flowrl-tok-")), arch["vocab_size"])
    if not ray.is_initialized():
        ray.init(num_cpus=max(64, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    return out, arch, tokenizer


def main() -> None:
    args = parse()
    on_gpu = torch.cuda.is_available() and not args.tiny
    out, arch, tokenizer = begin(args)
    models, share = build(args, on_gpu, tokenizer)
    texts, targets = make_prompts(args, arch["vocab_size"])
    rng = np.random.default_rng(args.seed)
    record: dict[str, Any] = {"command": shlex.join(sys.argv), "gpus": torch.cuda.device_count() if on_gpu else 0}
    record |= {"share": share, "episodes": {s: [] for s in SYSTEMS}}
    windows: dict[str, list[tuple[float, float]]] = {s: [] for s in SYSTEMS}
    sampler = GpuBusy() if on_gpu else None
    push = pull_push.Push(models, on_gpu)
    try:
        with flowrl.Pipeline(pull_push.rollout_flow(models), {"backend": "ray", "progress": "off"}) as pipe:
            for e in range(args.episodes):
                items = epoch_items(args, texts, targets, rng)
                tokens = sum(int(i["target"]) for i in items)
                for system in SYSTEMS if e % 2 == 0 else SYSTEMS[::-1]:
                    if system == "pull":
                        before = len(pipe.timeline.spans)
                        n, start, end, spans = pull_push.pull_episode(pipe, items)
                        calls = shard_calls(pipe.timeline.spans[before:], items)
                    else:
                        start = time.time()
                        n, spans = push.run(items)
                        end = time.time()
                    if n != len(items):
                        raise RuntimeError(f"{system} returned {n} of {len(items)} samples")
                    m = episode_metrics(spans, start, end, models, share) | {"tokens": tokens, "episode": e}
                    if system == "pull":
                        m["calls"] = calls
                        m["targets"] = [int(i["target"]) for i in items]
                    if e:  # the first episode of each system warms up (CUDA kernels, the allocator)
                        record["episodes"][system].append(m)
                        windows[system].append((start, end))
                    print(f"episode {e} {system}: {end - start:.2f} s", flush=True)
            record["pull shard sizes"] = {st.model: st.shard_sizes for st in pipe.stats().stages.values()}
    finally:
        push.close()
        if sampler is not None:
            sampler.stop()
    if sampler is not None:
        record["gpu_busy"] = {s: sampler.per_gpu(w) for s, w in windows.items()}
    record["predicted"] = predict(record["episodes"]["pull"], models)
    (out / "seed-layout.json").write_text(json.dumps(record, indent=1))
    (out / "seed-layout.md").write_text(markdown(record, args))
    print(markdown(record, args))


def markdown(record: dict[str, Any], args: argparse.Namespace) -> str:
    eps = record["episodes"]
    lines = [
        f"`{record['command']}`",
        "",
        f"{args.samples} samples an episode, responses of at most {args.tokens} tokens; policy "
        f"{args.policy_replicas} x batch {args.policy_batch}, reference / value / reward {args.scorer_replicas} x "
        f"batch {args.scorer_batch} each; {record['gpus']} GPU(s), each replica {record['share']['policy']:.3f} "
        f"of one; medians of {len(eps['pull'])} episodes per system after a warm-up one",
        "",
        "| system | rollout s | tokens/s | replicas used (policy / reference / value / reward) "
        "| busy s (policy / reference / value / reward) | idle GPU-s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for system in SYSTEMS:
        rs = eps[system]
        if not rs:
            continue
        med = {k: statistics.median(r[k] for r in rs) for k in ("s", "idle GPU-s", *ROLES)}
        used = " / ".join(str(max(r["replicas used"][m] for r in rs)) for m in ROLES)
        tokens = statistics.median(r["tokens"] / r["s"] for r in rs)
        lines.append(
            f"| {system} | {med['s']:.2f} | {tokens:.0f} | {used} | "
            f"{' / '.join(f'{med[m]:.2f}' for m in ROLES)} | {med['idle GPU-s']:.1f} |"
        )
    if eps["pull"] and eps["push"]:
        ratios = [b["s"] / a["s"] for a, b in zip(eps["pull"], eps["push"], strict=True)]
        lines += ["", f"push / pull per episode: {', '.join(f'{r:.2f}' for r in ratios)}"]
    for system, gpus in record.get("gpu_busy", {}).items():
        cells = ", ".join(f"GPU {i}: {v['median']:.0f}% / {v['mean']:.0f}%" for i, v in gpus.items())
        lines.append(f"\nGPU busy during {system} (nvidia-smi, median / mean): {cells}")
    pred, pulls = record.get("predicted", []), eps["pull"]
    if pred and eps["push"]:
        lines += [
            "",
            "The simulator (stage costs fitted on every measured pull call), per episode: measured / predicted s",
            "",
            "| episode | pull | push |",
            "| --- | --- | --- |",
        ]
        for p, a, b in zip(pred, pulls, eps["push"], strict=True):
            lines.append(f"| {a['episode']} | {a['s']:.2f} / {p['pull']:.2f} | {b['s']:.2f} / {p['push']:.2f} |")
    sizes = "; ".join(f"{m}: {v}" for m, v in record.get("pull shard sizes", {}).items())
    lines.append(f"\npull's shard sizes (size: calls, all episodes): {sizes}")
    return "\n".join(lines) + "\n"


def layout_arguments(p: argparse.ArgumentParser, out: str) -> None:
    """The layout's and the workload's options (seed_ppo.py takes them too)."""
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen2.5-0.5b")
    p.add_argument("--tokenizer", help="a tokenizer folder (default: a word-level one built here)")
    p.add_argument("--samples", type=int, default=128, help="samples an episode")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--tokens", type=int, default=256, help="the longest response")
    p.add_argument("--median", type=float, default=0.15, help="median target length, as a share of --tokens")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal shape of the prompts' target lengths")
    p.add_argument("--noise", type=float, default=0.3, help="lognormal shape of a sample's length around its prompt's")
    p.add_argument("--policy-replicas", type=int, default=2)
    p.add_argument("--policy-batch", type=int, default=64)
    p.add_argument("--scorer-replicas", type=int, default=8, help="replicas of reference, value and reward each")
    p.add_argument("--scorer-batch", type=int, default=32)
    p.add_argument("--step-timeout", type=float, default=600.0, help="seconds a step may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a small Llama on the CPU (a check)")
    p.add_argument("--out", default=os.environ.get("OUT", out))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    layout_arguments(p, "/tmp/flowrl-seed-layout")
    p.add_argument("--episodes", type=int, default=4, help="per system; the first warms up")
    args = p.parse_args()
    if args.samples % args.n or args.tokens < 2:
        p.error(f"--samples ({args.samples}) must be a multiple of --n ({args.n}), and --tokens at least 2")
    return args


if __name__ == "__main__":
    for module in (pull_push, hf_lengths):  # the replicas lack this folder on their path
        ray.cloudpickle.register_pickle_by_value(module)
    main()
