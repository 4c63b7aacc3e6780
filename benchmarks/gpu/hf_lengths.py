"""Length-aware scheduling on a real language model (issue 22; docs/gpu.md): flowrl.hf's
policy generates long-tailed responses, and three ways of scheduling it are run in turns,
epoch by epoch, in one process (so all see the same machine):

- ``pull+len``: a flowrl pipeline given each sample's predicted cost, its prompt's mean
  response length so far (``LengthMemory``; none in epoch 1): the longest work starts first
  and a shard holds samples of similar predicted length.
- ``pull``: the same pipeline without costs.
- ``push``: ChatLearn's static push: the epoch's samples in policy batches, batch ``i`` whole
  to replica ``i mod n``.

The policy is a real ``transformers`` architecture with random weights, built in code (no
download), with a word-level tokenizer built here too. A random model almost never samples its
eos, so every prompt carries a target length and the step forces eos there: each prompt draws
one target (lognormal, heavy tail, capped), each epoch a sample's length is that times a
lognormal noise, and the ``--n`` samples of a prompt share its target. A generation call
decodes until its longest row ends; the steps a row spends after its own eos are padding
waste, counted inside the step from the call's own output.

    python3 benchmarks/gpu/hf_lengths.py --out OUT                     # the H200 (see docs/gpu.md)
    python benchmarks/gpu/hf_lengths.py --tiny --epochs 3 --samples 32 --tokens 16   # a CPU check

Writes OUT/hf-lengths.md (tables, the command line first) and OUT/hf-lengths.json (every
rollout), rewritten after each rollout so that a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pull_push
import ray
import torch
from hf_grpo import ARCHS, GpuBusy

import flowrl
from flowrl import hf
from flowrl._core.scheduling.lengths import LengthMemory  # not re-exported by flowrl (yet)
from flowrl._sim.push import push_batches, push_replica

if TYPE_CHECKING:
    from collections.abc import Callable

MODES = ("pull+len", "pull", "push")
TINY = {  # a Llama a few MB in size, for the CPU check (heads of 32: vLLM's CPU attention takes no less)
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
OUT_FIELDS = ["tokens", "steps", "waste", "call_rows"]


# ---- the workload ----
def make_tokenizer(folder: Path, vocab: int) -> str:
    """A word-level tokenizer of exactly ``vocab`` tokens (``<pad>``, ``<eos>``, ``<unk>``,
    then ``w3`` ...), so every id the model can sample decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)
    return str(folder.resolve())


def make_prompts(args: argparse.Namespace, vocab: int) -> tuple[list[str], np.ndarray]:
    """Each prompt's text (16-48 random words) and its target response length: lognormal with
    median ``--median`` x ``--tokens`` and sigma ``--sigma``, capped so that eos still fits."""
    rng = np.random.default_rng(args.seed)
    count = args.samples // args.n
    texts = [" ".join(f"w{w}" for w in rng.integers(3, vocab, rng.integers(16, 49))) for _ in range(count)]
    targets = rng.lognormal(math.log(args.median * args.tokens), args.sigma, count)
    return texts, np.clip(np.round(targets), 1, args.tokens - 1).astype(int)


def epoch_items(
    args: argparse.Namespace, texts: list[str], targets: np.ndarray, rng: np.random.Generator
) -> list[dict[str, Any]]:
    """The epoch's samples: prompts in a new order, each ``--n`` times in a row (a GRPO group),
    each sample's length its prompt's target times its own lognormal noise."""
    items = []
    for key in rng.permutation(len(texts)):
        noise = rng.lognormal(0.0, args.noise, args.n)
        for f in noise:
            length = int(np.clip(round(float(targets[key]) * f), 1, args.tokens - 1))
            items.append({"prompt": texts[key], "key": int(key), "target": length})
    return items


# ---- the policy ----
class EndAt:
    """A logits processor: row ``i`` samples eos at step ``targets[i]`` and never before (nor
    any other stop token)."""

    def __init__(self, targets: torch.Tensor, width: int, eos: int, stops: list[int]) -> None:
        self.targets, self.width, self.eos, self.stops = targets, width, eos, stops

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width
        due = self.targets.to(scores.device) == step
        scores[:, self.stops] = -math.inf
        scores[due] = -math.inf
        scores[due, self.eos] = 0.0
        return scores


class LengthPolicy(hf.HFPolicy):
    """HFPolicy whose responses end at each sample's ``target`` length, and which reports per
    sample its real tokens (before eos), its call's decode steps and its padding waste."""

    def setup(self) -> None:
        super().setup()
        from transformers import LogitsProcessorList

        self.due = torch.zeros(0, dtype=torch.long)
        self.last_steps = 0
        module: Any = self.module
        inner: Callable[..., torch.Tensor] = module.generate
        eos = int(self.tokenizer.eos_token_id)

        # HFPolicy takes no logits processor of ours: wrap the network's generate, which it calls
        # once per step with the left-padded prompts (the width the steps count from); the
        # forcing comes after the policy's own processors (its per-row sampling)
        def generate(*a: Any, **kw: Any) -> torch.Tensor:
            width = int(kw["input_ids"].shape[1])
            own = list(kw.pop("logits_processor", None) or [])
            forcing = LogitsProcessorList([*own, EndAt(self.due, width, eos, self.stop_ids)])
            out = inner(*a, logits_processor=forcing, **kw)
            self.last_steps = int(out.shape[1]) - width
            return out

        module.generate = generate

    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self.due = torch.as_tensor(np.asarray(batch["target"]), dtype=torch.long)
        out = dict(super().forward_step(batch, iteration))
        ended = [
            len(r) - (reason == "stop") for r, reason in zip(out["response_ids"], out["finish_reason"], strict=True)
        ]
        lengths = torch.tensor([len(r) for r in out["response_ids"]], dtype=torch.long)
        steps = self.last_steps
        out["tokens"] = torch.tensor(ended, dtype=torch.long)
        out["steps"] = torch.full((len(batch),), steps, dtype=torch.long)
        out["waste"] = steps - lengths  # decode steps after the row's eos (the eos itself is real)
        out["call_rows"] = torch.full((len(batch),), len(batch), dtype=torch.long)
        return out


def build_policy(args: argparse.Namespace, on_gpu: bool, tokenizer: str) -> LengthPolicy:
    arch = TINY if args.tiny else ARCHS[args.arch]
    share = 0.5 / args.policy_replicas  # pull's and push's replicas are alive at once: half the GPU each
    lm = hf.LM(config=arch, tokenizer=tokenizer, dtype="bfloat16" if on_gpu else "float32")
    sampling = {"max_new_tokens": args.tokens, "temperature": 1.0, "chat_template": False}
    policy = LengthPolicy(
        "policy",
        {
            "num_replicas": args.policy_replicas,
            "batch_size": args.policy_batch,
            "cpus_per_replica": 1,
            "call_timeout_s": args.step_timeout,
            **({"gpus_per_replica": share} if on_gpu else {}),
        },
        lm=lm,
        sampling=sampling,
    )
    return policy


# ---- static push ----
class Push:
    """ChatLearn's static push: policy batch ``i`` whole to replica ``i mod n``."""

    def __init__(self, policy: flowrl.Model, on_gpu: bool, timeout_s: float) -> None:
        cfg = policy.config
        opts = {"num_cpus": cfg.cpus_per_replica, "num_gpus": cfg.gpus_per_replica if on_gpu else 0}
        actor: Any = pull_push.PushReplica  # the GPU push baseline's replica, shared with seed_layout.py
        self.actors = [actor.options(**opts).remote(policy, r) for r in range(cfg.replicas)]
        self.batch = cfg.batch_size
        self.timeout_s = timeout_s
        ray.get([a.ready.remote() for a in self.actors], timeout=timeout_s)

    def run(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        done = []
        for i, ids in enumerate(push_batches(len(items), self.batch)):
            batch = flowrl.Batch.from_samples(list(ids), [items[j] for j in ids])
            out, _span = self.actors[push_replica(i, len(self.actors))].run.remote(batch)
            done.append(out)
        rounds = math.ceil(len(done) / len(self.actors))  # the calls queued on one replica
        batches = ray.get(done, timeout=self.timeout_s * rounds)
        return [{f: b[f][j] for f in OUT_FIELDS} for b in batches for j in range(len(b))]

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


# ---- one rollout, measured ----
def grouped_waste(lengths: list[int], by: list[float], batch: int) -> float:
    """For reference: the waste of batches of ``batch`` cut from the samples sorted by ``by``
    (their true lengths: a perfect predictor; their predicted costs: the best grouping that
    the predictions allow, the noise of a sample around its prompt being unpredictable)."""
    order = sorted(range(len(lengths)), key=lambda i: -by[i])
    calls = [[lengths[i] for i in order[lo : lo + batch]] for lo in range(0, len(order), batch)]
    generated = sum(len(c) * (max(c) + 1) for c in calls)  # each call decodes to its longest eos
    return 1 - sum(n + 1 for n in lengths) / generated


def measure(
    rows: list[dict[str, Any]], items: list[dict[str, Any]], seconds: float, busy: dict[str, float] | None
) -> dict[str, Any]:
    tokens = sum(int(r["tokens"]) for r in rows)
    steps = sum(int(r["steps"]) for r in rows)  # all generated: rows x decode steps of each call
    waste = sum(int(r["waste"]) for r in rows)
    return {
        "s": seconds,
        "samples": len(rows),
        "tokens": tokens,
        "generated": steps,
        "waste_tokens": waste,
        "waste": waste / steps if steps else 0.0,
        "tokens_per_s": tokens / seconds,
        "calls": round(sum(1 / int(r["call_rows"]) for r in rows)),
        # samples whose response did not end at its target (none, unless eos forcing broke)
        "off_target": sum(int(r["tokens"]) != it["target"] for r, it in zip(rows, items, strict=True)),
        "gpu_median": busy["median"] if busy else None,
        "gpu_mean": busy["mean"] if busy else None,
        "gpu_samples": busy["samples"] if busy else 0,
    }


class Bench:
    """The run: the three modes in turns each epoch, every rollout measured and written."""

    def __init__(self, args: argparse.Namespace, push: Push, pipe: flowrl.Pipeline, record: dict[str, Any]) -> None:
        self.args, self.push, self.pipe, self.record = args, push, pipe, record
        self.on_gpu: bool = record["on_gpu"]
        self.memory = LengthMemory()

    def epoch(self, epoch: int, items: list[dict[str, Any]]) -> None:
        keys = [it["key"] for it in items]
        self.reference(epoch, items, keys)
        turn = (epoch - 1) % len(MODES)  # who goes first rotates: no mode always follows another
        for mode in MODES[turn:] + MODES[:turn]:
            rows, seconds, busy = self.timed(mode, items, keys)
            if len(rows) != len(items):
                raise RuntimeError(f"{mode} returned {len(rows)} of {len(items)} samples")
            if mode == "pull+len":  # the memory learns from its own rollouts
                self.memory.observe(keys, [float(r["tokens"]) for r in rows])
            m = {"epoch": epoch, "mode": mode} | measure(rows, items, seconds, busy)
            self.record["rollouts"].append(m)
            log(line(m))
            write(Path(self.args.out), self.record, self.args)

    def reference(self, epoch: int, items: list[dict[str, Any]], keys: list[int]) -> None:
        lengths = [it["target"] for it in items]
        batch = self.args.policy_batch
        refs = {
            "epoch": epoch,
            "oracle": grouped_waste(lengths, [float(n) for n in lengths], batch),
            "predicted": grouped_waste(lengths, self.memory.costs(keys), batch) if len(self.memory) else None,
        }
        self.record["reference_waste"].append(refs)
        log(f"epoch {epoch}: waste of batches of {batch} sorted by " + reference(refs))

    def timed(
        self, mode: str, items: list[dict[str, Any]], keys: list[int]
    ) -> tuple[list[dict[str, Any]], float, dict[str, float] | None]:
        costs = self.memory.costs(keys) if mode == "pull+len" and len(self.memory) else None
        sampler = GpuBusy() if self.on_gpu else None
        start = time.perf_counter()
        try:
            if mode == "push":
                rows = self.push.run(items)
            else:
                samples = self.pipe.run(items, fields=OUT_FIELDS, costs=costs)
                rows = [{f: s[f] for f in OUT_FIELDS} for s in samples]
        finally:
            seconds = time.perf_counter() - start
            busy = sampler.stop() if sampler is not None else None
        return rows, seconds, busy


def main() -> None:
    start = time.perf_counter()
    args = parse()
    on_gpu = torch.cuda.is_available() and not args.tiny
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python3 " + shlex.join([sys.argv[0], *sys.argv[1:]])
    log(f"{command}\non {'GPU ' + torch.cuda.get_device_name(0) if on_gpu else 'CPU'}; results in {out}")
    if not ray.is_initialized():
        gpus = torch.cuda.device_count() if on_gpu else 0
        ray.init(num_cpus=max(16, os.cpu_count() or 1), num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    arch: dict[str, Any] = TINY if args.tiny else ARCHS[args.arch]
    vocab = int(arch["vocab_size"])
    tokenizer = args.tokenizer or make_tokenizer(Path(tempfile.mkdtemp(prefix="flowrl-tok-")), vocab)
    texts, targets = make_prompts(args, vocab)
    policy = build_policy(args, on_gpu, tokenizer)
    log(f"{len(texts)} prompts x {args.n}; target lengths: median {np.median(targets):.0f}, max {targets.max()}")
    record: dict[str, Any] = {"command": command, "args": vars(args), "on_gpu": on_gpu}
    record |= {"rollouts": [], "reference_waste": []}
    rng = np.random.default_rng(args.seed + 1)
    push = Push(policy, on_gpu, args.step_timeout)
    config = {"backend": "ray", "progress": "off", "setup_timeout_s": args.step_timeout}
    config |= {"input_chunk": args.input_chunk}
    try:
        flow: Any = policy.forward_step  # a flow of one stage
        with flowrl.Pipeline(flow, config) as pipe:
            log(f"replicas ready in {time.perf_counter() - start:.1f} s")
            bench = Bench(args, push, pipe, record)
            for epoch in range(1, args.epochs + 1):
                began = time.perf_counter()
                bench.epoch(epoch, epoch_items(args, texts, targets, rng))  # the same samples for every mode
                took = time.perf_counter() - began
                if args.budget_s and time.perf_counter() - start + took > args.budget_s and epoch < args.epochs:
                    log(f"stopping after epoch {epoch}: another ({took:.0f} s) would pass --budget-s {args.budget_s:g}")
                    break
            record["shard_sizes"] = {st.model: st.shard_sizes for st in pipe.stats().stages.values()}
    finally:
        push.close()
    record["wall_s"] = time.perf_counter() - start
    write(out, record, args)
    print("\n" + (out / "hf-lengths.md").read_text(), flush=True)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=sorted(ARCHS), default="smollm2-135m")
    p.add_argument("--tokenizer", help="a tokenizer folder (default: a word-level one built here)")
    p.add_argument("--tiny", action="store_true", help="a few-MB Llama on the CPU (a check)")
    p.add_argument("--epochs", type=int, default=4, help="over the same prompts; the first warms up")
    p.add_argument("--samples", type=int, default=256, help="per epoch (prompts x --n)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (a GRPO group)")
    p.add_argument("--tokens", type=int, default=512, help="max_new_tokens")
    p.add_argument("--median", type=float, default=0.15, help="prompts' median target length, a share of --tokens")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the prompts' targets")
    p.add_argument("--noise", type=float, default=0.3, help="lognormal sigma of a sample around its target")
    p.add_argument("--policy-replicas", type=int, help="default 4 (2 with --tiny)")
    p.add_argument("--policy-batch", type=int, help="default 32 (8 with --tiny)")
    p.add_argument("--step-timeout", type=float, default=300.0, help="seconds a call (or replica start) may take")
    p.add_argument(
        "--input-chunk",
        type=int,
        default=4096,
        help="PipelineConfig.input_chunk: the longest-first order holds only among the items admitted so far, "
        "and the first shards are cut as the first chunk arrives (flowrl's default 64 loses a part of the grouping)",
    )
    p.add_argument("--budget-s", type=float, help="start no epoch that would end past this many seconds of run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/flowrl-hf-lengths")
    args = p.parse_args()
    args.policy_replicas = args.policy_replicas or (2 if args.tiny else 4)
    args.policy_batch = args.policy_batch or (8 if args.tiny else 32)
    if args.samples % args.n or args.tokens < 2:
        p.error(f"--samples ({args.samples}) must be a multiple of --n ({args.n}), and --tokens at least 2")
    return args


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def reference(refs: dict[str, Any]) -> str:
    predicted = "-" if refs["predicted"] is None else f"{refs['predicted']:.1%}"
    return f"true length (an oracle): {refs['oracle']:.1%}; by the predictions: {predicted}"


def line(m: dict[str, Any]) -> str:
    gpu = f", GPU {m['gpu_median']:.0f}% / {m['gpu_mean']:.1f}%" if m["gpu_samples"] else ""
    off = f", {m['off_target']} samples OFF their target length" if m["off_target"] else ""
    return (
        f"epoch {m['epoch']} {m['mode']}: {m['s']:.2f} s, {m['tokens_per_s']:.0f} tokens/s, "
        f"waste {m['waste']:.1%}, {m['calls']} calls{gpu}{off}"
    )


# ---- the report ----
def summary(rollouts: list[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    """Over epochs >= 2 (the first warms up and has no length history): median seconds, and
    tokens, waste and GPU busy over all those rollouts."""
    rs = [r for r in rollouts if r["mode"] == mode and r["epoch"] >= 2]
    if not rs:
        return None
    gpu = [r for r in rs if r["gpu_samples"]]
    return {
        "epochs": len(rs),
        "s": statistics.median(r["s"] for r in rs),
        "tokens_per_s": sum(r["tokens"] for r in rs) / sum(r["s"] for r in rs),
        "waste": sum(r["waste_tokens"] for r in rs) / sum(r["generated"] for r in rs),
        "calls": statistics.median(r["calls"] for r in rs),
        "gpu_median": statistics.median(r["gpu_median"] for r in gpu) if gpu else None,
        "gpu_mean": sum(r["gpu_mean"] * r["gpu_samples"] for r in gpu) / sum(r["gpu_samples"] for r in gpu)
        if gpu
        else None,
    }


def write(out: Path, record: dict[str, Any], args: argparse.Namespace) -> None:
    record["summary"] = {m: summary(record["rollouts"], m) for m in MODES}
    (out / "hf-lengths.json").write_text(json.dumps(record, indent=1))
    (out / "hf-lengths.md").write_text(markdown(record, args))


def markdown(record: dict[str, Any], args: argparse.Namespace) -> str:
    arch = "tiny Llama" if args.tiny else args.arch
    where = "GPU" if record["on_gpu"] else "CPU"
    lines = [
        f"`{record['command']}`",
        "",
        f"{arch} (random weights) on the {where}: {args.samples // args.n} prompts x {args.n} samples, at most "
        f"{args.tokens} new tokens, lengths lognormal (median {args.median:g} x max, sigma {args.sigma:g}; "
        f"noise {args.noise:g}), policy {args.policy_replicas} replicas x batch {args.policy_batch}, "
        f"input_chunk {args.input_chunk}.",
        "",
        "| mode | rollout s (median) | tokens/s | padding waste | policy calls | GPU busy median / mean |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    summaries = record["summary"]
    for mode in MODES:
        s = summaries[mode]
        if s is not None:
            gpu = f"{s['gpu_median']:.0f}% / {s['gpu_mean']:.1f}%" if s["gpu_median"] is not None else "-"
            lines.append(
                f"| {mode} | {s['s']:.2f} | {s['tokens_per_s']:.0f} | {s['waste']:.1%} | {s['calls']:g} | {gpu} |"
            )
    push, ours = summaries["push"], summaries["pull+len"]
    if push and ours:
        share = f"{ours['waste'] / push['waste']:.2f}" if push["waste"] else "-"
        last = max(r["epoch"] for r in record["rollouts"])
        later = [r for r in record["reference_waste"] if 2 <= r["epoch"] <= last and r["predicted"] is not None]
        refs = {k: statistics.fmean(r[k] for r in later) for k in ("oracle", "predicted")}
        lines += [
            "",
            f"Epochs 2-{last}: push's rollout time / pull+len's: {push['s'] / ours['s']:.2f}x; pull+len's waste / "
            f"push's: {share}. For reference, the waste of batches of {args.policy_batch} cut from the samples "
            f"sorted by {reference(refs)} (mean over epochs).",
        ]
    lines += ["", "| epoch | mode | rollout s | tokens/s | waste | calls | GPU median / mean |"]
    lines.append("| --- | --- | --- | --- | --- | --- | --- |")
    for r in record["rollouts"]:
        gpu = f"{r['gpu_median']:.0f}% / {r['gpu_mean']:.1f}%" if r["gpu_samples"] else "-"
        lines.append(
            f"| {r['epoch']} | {r['mode']} | {r['s']:.2f} | {r['tokens_per_s']:.0f} | {r['waste']:.1%} "
            f"| {r['calls']} | {gpu} |"
        )
    if "shard_sizes" in record:
        lines += ["", f"pull's shard sizes (size: calls, both pull modes, all epochs): {record['shard_sizes']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
