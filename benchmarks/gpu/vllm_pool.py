"""Generation by a pool of vLLM engines sharing one GPU, through flowrl's pipeline on Ray, against
Hugging Face ``generate`` through the same pipeline, in one run (issue 41's rollout target;
docs/vllm.md).

One engine keeps an H200 26-38 % busy at 1,024 prompts of a 0.5B model: a decode step of so small
a model is shorter than the engine's Python around it (docs/vllm.md). A flowrl pool of N
``VLLMPolicy`` replicas with ``gpus_per_replica`` 1/N runs N engines on the GPU, each in its own
process, and the splitter feeds each as it frees up: while one engine runs its Python, another's
kernels run.

For each ``--replicas`` N (0: ``generate``, one ``HFPolicy`` replica): the pool started, a warm-up
run of ``--prompts`` prompts, then ``--repeats`` timed runs (``generate`` too: on a GPU its first
run after the warm-up may still be cut in two, docs/vllm.md):
generated tokens/s, nvidia-smi's utilization during the timed runs (median, mean), and how the
stage's shards went (calls, the largest shard, samples per replica).

    python3 benchmarks/gpu/vllm_pool.py --tokenizer T --prompts 1024 --out OUT   # the GPU
    python benchmarks/gpu/vllm_pool.py --tokenizer T --arch tiny --replicas 1,2,0 --prompts 8 --new 8 --out /tmp/p

Writes OUT/vllm-pool-<arch>.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_grpo import GpuBusy  # noqa: E402
from vllm_rollout import make_lm, model_arguments, words  # noqa: E402

import flowrl  # noqa: E402
from flowrl import hf  # noqa: E402


def policy(args: argparse.Namespace, replicas: int, logprobs: bool, cuda: bool) -> flowrl.Model:
    """``replicas`` engines sharing the GPU, or ``generate`` (``replicas`` 0) on all of it."""
    batch = math.ceil(args.prompts / max(1, replicas))
    config: dict[str, Any] = {"num_replicas": max(1, replicas), "batch_size": batch, "cpus_per_replica": 1}
    if cuda:
        config["gpus_per_replica"] = 1 / max(1, replicas)
    sampling = {"max_new_tokens": args.new, "temperature": 1.0, "chat_template": False}
    if replicas == 0:
        return hf.HFPolicy("policy", config, lm=make_lm(args), sampling=sampling)
    from flowrl.vllm import VLLMPolicy

    engine = {
        "gpu_memory_utilization": args.memory / replicas,
        "max_num_seqs": max(256, batch),  # a replica's whole shard in the running batch at once
        "logprobs": logprobs,
        # a fixed KV cache: vLLM's profile of free memory is wrong while the other engines load
        "engine_args": {"kv_cache_memory_bytes": int(args.kv_gib * 2**30)} if cuda else {},
    }
    return VLLMPolicy("policy", config, lm=make_lm(args), sampling=sampling, engine=engine)


def measure(args: argparse.Namespace, pool: str, cuda: bool, busy: GpuBusy | None) -> dict[str, Any]:
    replicas = int(pool.rstrip("n"))
    logprobs = replicas == 0 or not (args.no_logprobs or pool.endswith("n"))  # generate always has them
    model = policy(args, replicas, logprobs, cuda)
    items = [{"prompt": w} for w in words(args.prompts)]
    start = time.perf_counter()
    with flowrl.Pipeline(lambda prompts: model.forward_step(prompts), {"backend": "ray", "progress": "off"}) as pipe:
        started = time.perf_counter() - start
        pipe.run(items)  # warm-up: CUDA's first calls, the splitter's first fit of the call cost
        runs, windows = [], []
        for _ in range(args.repeats):
            begin, wall = time.perf_counter(), time.time()
            samples = pipe.run(items)
            runs.append((sum(len(s["response_ids"]) for s in samples), time.perf_counter() - begin))
            windows.append((wall, time.time()))
        stage = pipe.stats().stages["policy.forward_step"]
    result: dict[str, Any] = {
        "replicas": replicas or 1,
        "engine": "vllm" if replicas else "generate",
        "logprobs": logprobs,
        "start_s": round(started, 1),
        "tokens_per_s": [round(t / s, 1) for t, s in runs],
        "seconds": [round(s, 3) for _, s in runs],
        "tokens": runs[0][0],
        "calls": stage.calls,
        "max_shard": stage.max_shard,
        "samples_per_replica": [r.samples for r in stage.replicas],
    }
    if busy is not None:
        result["gpu_busy"] = busy.per_gpu(windows)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser, prompts=1024)
    parser.add_argument(
        "--replicas",
        default="4,0,1,2",
        help="engines on the GPU, one pool after another (0: generate; a trailing n: without log-probs, e.g. 2n)",
    )
    parser.add_argument("--memory", type=float, default=0.8, help="the GPU's share all engines together may take")
    parser.add_argument("--kv-gib", type=float, default=4.0, help="each engine's KV cache")
    parser.add_argument("--no-logprobs", action="store_true", help="VLLMConfig.logprobs=False in every pool")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    bad = [pool for pool in args.replicas.split(",") if not re.fullmatch(r"\d+n?", pool)]
    if bad:  # before any engine starts: a typo found after minutes of engine starts costs device time
        parser.error(
            f"--replicas: each entry is a count of engines, n after it for no log-probs (e.g. 0,2n,3); got {bad}"
        )
    cuda = torch.cuda.is_available()
    ray.init(num_cpus=max(16, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    busy = GpuBusy() if cuda else None
    record: dict[str, Any] = {"arch": args.arch, "prompts": args.prompts, "new": args.new, "cuda": cuda}
    record |= {"logprobs": not args.no_logprobs, "kv_gib": args.kv_gib, "runs": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for pool in args.replicas.split(","):
        record["runs"].append(measure(args, pool, cuda, busy))
        print(json.dumps(record["runs"][-1]), flush=True)
        (out / f"vllm-pool-{args.arch}.json").write_text(json.dumps(record, indent=1))
    rates = {
        r["engine"] + str(r["replicas"]) + ("" if r["logprobs"] else "n"): statistics.median(r["tokens_per_s"])
        for r in record["runs"]
    }
    if "generate1" in rates:
        record["speedup"] = {k: round(v / rates["generate1"], 2) for k, v in rates.items()}
    (out / f"vllm-pool-{args.arch}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
