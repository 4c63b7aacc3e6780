"""Seconds per decode step of flowrl.hf's policy, in this process and inside a bare Ray actor
(one CPU, half the GPU, as in hf_grpo.py), against ``generate`` alone (hf_generate.py).

    python benchmarks/gpu/hf_policy_step.py --arch qwen2.5-0.5b --tokenizer DIR
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import ray
import torch
from hf_grpo import ARCHS

import flowrl
from flowrl import hf


def timed(arch: str, tokenizer: str, batch: int, new: int, threads: int | None) -> dict[str, float]:
    if threads:
        torch.set_num_threads(threads)
    lm = hf.LM(config=ARCHS[arch], tokenizer=tokenizer, dtype="bfloat16")
    policy = hf.HFPolicy("policy", lm=lm, sampling={"max_new_tokens": new, "stop_token_ids": ()})
    policy.gpu_ids = [0]
    policy.setup()
    policy.stop_ids = []  # a random model: run every step, as the benchmark does
    items = [{"prompt": f"What is {i} + {i + 1}?"} for i in range(batch)]
    b = flowrl.Batch.from_samples(list(range(batch)), items)
    policy.forward_step(b, 0)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    prompts = [policy.encode(p) for p in b["prompt"]]
    policy.generate(prompts, policy.sampling, b)
    torch.cuda.synchronize()
    gen = time.perf_counter() - t
    t = time.perf_counter()
    policy.forward_step(b, 0)
    torch.cuda.synchronize()
    step = time.perf_counter() - t
    return {"generate_ms_per_step": 1000 * gen / new, "forward_step_ms_per_token": 1000 * step / new}


@ray.remote(num_cpus=1, num_gpus=0.5)
def in_actor(*args: Any) -> dict[str, float]:
    return timed(*args)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen2.5-0.5b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    a = parser.parse_args()
    print("here:", timed(a.arch, a.tokenizer, a.batch, a.new, None), flush=True)
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False)
    print("ray task, 1 cpu:", ray.get(in_actor.remote(a.arch, a.tokenizer, a.batch, a.new, None)), flush=True)
    print("ray task, 1 cpu, 4 threads:", ray.get(in_actor.remote(a.arch, a.tokenizer, a.batch, a.new, 4)), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
