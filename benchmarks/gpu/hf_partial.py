"""Partial rollouts on a real language model (issue 23; docs/gpu.md): flowrl.hf's policy writes
long-tailed responses either in one call each (``whole``: ``forward_step``, a flowrl pipeline of
one stage) or a segment of at most ``--segment`` tokens a call (``partial``: a ``flowrl.loop``
over ``HFPolicy.continue_step``; the prefix is encoded again at every segment), at the same
token budget (``--tokens``, the longest response). The modes run in turns, ``--repeats`` times,
in one process.

``--modes`` adds, in the same run: ``push`` (ChatLearn's static push, hf_lengths.py's),
``whole+len`` and ``partial+len`` (each sample's predicted cost: its prompt's mean response
length in the rollouts before, from a ``LengthMemory`` fed by ``whole+len``'s rollouts; none in
the first repeat, which is left out of the summary when any ``+len`` mode runs).

The workload is hf_lengths.py's (random-weight SmolLM2-135M architecture, a word-level
tokenizer built here, eos forced at each sample's target length, prompt-correlated long tails).
Reported per mode: rollout seconds, tokens/s, padding waste (decode steps a row spends after
its own eos, as a share of all decode steps), policy calls, GPU busy (nvidia-smi).

    python3 benchmarks/gpu/hf_partial.py --out OUT                          # the H200
    python benchmarks/gpu/hf_partial.py --tiny --repeats 1 --samples 32 --tokens 32 --segment 8   # a CPU check
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
from hf_grpo import ARCHS, GpuBusy
from hf_lengths import TINY, LengthPolicy, Push, epoch_items, make_prompts, make_tokenizer

import flowrl
from flowrl import hf
from flowrl._core.scheduling.lengths import LengthMemory

MODES = ("whole", "partial", "push", "whole+len", "partial+len")
FIELDS = ["tokens", "steps", "waste"]  # per sample, summed over its segments


class SegmentPolicy(LengthPolicy):
    """LengthPolicy whose ``continue_step`` also ends each response at its target: the eos is
    due ``target - written so far`` steps into a segment (or not in this one)."""

    @flowrl.step
    @torch.no_grad()
    def continue_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        written = torch.tensor([len(r) for r in batch["response_ids"]], dtype=torch.long)
        self.due = torch.as_tensor(np.asarray(batch["target"]), dtype=torch.long) - written
        out = dict(super().continue_step(batch, iteration))
        new = [len(r) - int(w) for r, w in zip(out["response_ids"], written, strict=True)]
        ended = [bool(f) and why == "stop" for f, why in zip(out["finished"], out["finish_reason"], strict=True)]
        steps = self.last_steps
        out["tokens"] = [int(t) + n - e for t, n, e in zip(batch["tokens"], new, ended, strict=True)]
        out["steps"] = [int(s) + steps for s in batch["steps"]]
        out["waste"] = [int(w) + (steps - n if e else 0) for w, n, e in zip(batch["waste"], new, ended, strict=True)]
        return out


def build(args: argparse.Namespace, on_gpu: bool, tokenizer: str) -> tuple[SegmentPolicy, SegmentPolicy]:
    arch = TINY if args.tiny else ARCHS[args.arch]
    lm = hf.LM(config=arch, tokenizer=tokenizer, dtype="bfloat16" if on_gpu else "float32")
    sets = 3 if "push" in args.modes else 2  # the pipelines' replicas and push's are alive at once
    share = {"gpus_per_replica": 1 / sets / args.policy_replicas} if on_gpu else {}
    config = {
        "num_replicas": args.policy_replicas,
        "batch_size": args.policy_batch,
        "cpus_per_replica": 1,
        "call_timeout_s": args.step_timeout,
        **share,
    }
    base = {"temperature": 1.0, "chat_template": False}
    whole = SegmentPolicy("whole", config, lm=lm, sampling={**base, "max_new_tokens": args.tokens})
    partial = SegmentPolicy(
        "partial", config, lm=lm, sampling={**base, "max_new_tokens": args.segment, "max_response_tokens": args.tokens}
    )
    return whole, partial


def whole_row(sample: flowrl.Sample) -> dict[str, int]:
    return {f: int(sample[f]) for f in FIELDS}


def run_mode(
    runner: Any, mode: str, items: list[dict[str, Any]], on_gpu: bool, costs: list[float] | None
) -> dict[str, Any]:
    """One rollout of ``items`` (``runner``: the mode's pipeline, or push's actors), measured."""
    stage = {"whole": "whole.forward_step", "partial": "partial.continue_step"}.get(mode.removesuffix("+len"))
    calls = runner.stats()[stage].calls if stage else 0
    sampler = GpuBusy() if on_gpu else None
    start = time.perf_counter()
    try:
        if mode == "push":
            rows = [{f: int(r[f]) for f in FIELDS} | {"calls": 1 / int(r["call_rows"])} for r in runner.run(items)]
        elif mode.startswith("whole"):
            rows = [whole_row(s) for s in runner.run(items, fields=FIELDS, costs=costs)]
        else:
            state = [{**it, "response_ids": [], "logprobs": [], "tokens": 0, "steps": 0, "waste": 0} for it in items]
            out = runner.run(state, fields=[*FIELDS, "segment_turns"], costs=costs)
            rows = [{**{f: int(s[f]) for f in FIELDS}, "segments": int(s["segment_turns"])} for s in out]
    finally:
        seconds = time.perf_counter() - start
        busy = sampler.stop() if sampler is not None else None
    off = sum(r["tokens"] != it["target"] for r, it in zip(rows, items, strict=True))
    steps = sum(r["steps"] for r in rows)
    return {
        "mode": mode,
        "s": seconds,
        "tokens": sum(r["tokens"] for r in rows),
        "tokens_per_s": sum(r["tokens"] for r in rows) / seconds,
        "waste": sum(r["waste"] for r in rows) / steps if steps else 0.0,
        "calls": runner.stats()[stage].calls - calls if stage else round(sum(r["calls"] for r in rows)),
        "segments": sum(r.get("segments", 1) for r in rows),
        "lengths": [r["tokens"] for r in rows],  # what the length memory learns from
        "off_target": off,
        "gpu_median": busy["median"] if busy else None,
        "gpu_mean": busy["mean"] if busy else None,
    }


def main() -> None:
    args = parse()
    on_gpu = torch.cuda.is_available() and not args.tiny
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python3 " + shlex.join([sys.argv[0], *sys.argv[1:]])
    print(command, flush=True)
    if not ray.is_initialized():
        gpus = torch.cuda.device_count() if on_gpu else 0
        ray.init(num_cpus=max(16, os.cpu_count() or 1), num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    arch: dict[str, Any] = TINY if args.tiny else ARCHS[args.arch]
    vocab = int(arch["vocab_size"])
    tokenizer = make_tokenizer(Path(tempfile.mkdtemp(prefix="flowrl-tok-")), vocab)
    args.median, args.sigma, args.noise, args.n = 0.15, 1.0, 0.3, 4  # hf_lengths.py's workload
    texts, targets = make_prompts(args, vocab)
    whole, partial = build(args, on_gpu, tokenizer)
    rng = np.random.default_rng(args.seed + 1)
    config = {"backend": "ray", "progress": "off", "setup_timeout_s": args.step_timeout, "input_chunk": 4096}
    record: dict[str, Any] = {"command": command, "args": vars(args), "on_gpu": on_gpu, "rollouts": []}

    def looped(x: Any) -> Any:
        return flowrl.loop(partial.continue_step, x, until="finished", max_turns=args.tokens, name="segment")

    push = Push(whole, on_gpu, args.step_timeout) if "push" in args.modes else None
    memory = LengthMemory()
    try:
        with flowrl.Pipeline(whole.forward_step, config) as one, flowrl.Pipeline(looped, config) as many:
            runners = {"whole": one, "partial": many, "push": push}
            for r in range(args.repeats):
                items = epoch_items(args, texts, targets, rng)  # the same samples for every mode
                keys = [it["key"] for it in items]
                order = args.modes[r % len(args.modes) :] + args.modes[: r % len(args.modes)]  # who goes first rotates
                for mode in order:
                    costs = memory.costs(keys) if mode.endswith("+len") and len(memory) else None
                    m = {"repeat": r} | run_mode(runners[mode.removesuffix("+len")], mode, items, on_gpu, costs)
                    if mode == "whole+len":  # the memory learns from its own rollouts
                        memory.observe(keys, [float(t) for t in m.pop("lengths")])
                    m.pop("lengths", None)
                    record["rollouts"].append(m)
                    print(json.dumps(m), flush=True)
                    (out / "hf-partial.json").write_text(json.dumps(record, indent=1))
    finally:
        if push is not None:
            push.close()
    print("\n" + report(record, args), flush=True)
    (out / "hf-partial.md").write_text(report(record, args))


def report(record: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"`{record['command']}`",
        "",
        "| mode | rollout s (median) | tokens/s | padding waste | policy calls | segments | GPU busy median / mean |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    learning = any(m.endswith("+len") for m in args.modes)  # the first repeat has no history: left out
    for mode in args.modes:
        rs = [r for r in record["rollouts"] if r["mode"] == mode and (r["repeat"] > 0 or not learning)]
        if not rs:
            continue
        gpu = "-"
        if rs[0]["gpu_median"] is not None:
            median, mean = statistics.median(r["gpu_median"] for r in rs), statistics.fmean(r["gpu_mean"] for r in rs)
            gpu = f"{median:.0f}% / {mean:.1f}%"
        lines.append(
            f"| {mode} | {statistics.median(r['s'] for r in rs):.2f} | "
            f"{sum(r['tokens'] for r in rs) / sum(r['s'] for r in rs):.0f} | "
            f"{statistics.fmean(r['waste'] for r in rs):.1%} | {statistics.median(r['calls'] for r in rs):g} | "
            f"{statistics.median(r['segments'] for r in rs):g} | {gpu} |"
        )
    off = sum(r["off_target"] for r in record["rollouts"])
    lines += ["", f"samples off their target length: {off} (0 means every response ended where it was meant to)"]
    return "\n".join(lines) + "\n"


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=sorted(ARCHS), default="smollm2-135m")
    p.add_argument("--tiny", action="store_true", help="a few-MB Llama on the CPU (a check)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--tokens", type=int, default=512, help="the longest response (both modes)")
    p.add_argument("--segment", type=int, default=128, help="partial: tokens per sample per call")
    p.add_argument("--policy-replicas", type=int, help="default 4 (2 with --tiny)")
    p.add_argument("--policy-batch", type=int, help="default 32 (8 with --tiny)")
    p.add_argument("--step-timeout", type=float, default=300.0)
    p.add_argument("--modes", default="whole,partial", help=f"a comma list of {', '.join(MODES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/flowrl-hf-partial")
    args = p.parse_args()
    args.policy_replicas = args.policy_replicas or (2 if args.tiny else 4)
    args.policy_batch = args.policy_batch or (8 if args.tiny else 32)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown or not args.modes:
        p.error(f"--modes: unknown {unknown}; choose among {', '.join(MODES)}")
    return args


if __name__ == "__main__":
    main()
