"""How fast ``transformers``' generate samples on this GPU, outside flowrl: seconds per decode
step for a batch, with the default dynamic KV cache and with torch's thread count at 1 (as in
a Ray actor with one CPU) or the machine's. Random weights from a real config.

    python benchmarks/gpu/hf_generate.py --arch qwen2.5-0.5b --tokenizer DIR
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from hf_grpo import ARCHS
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", default="qwen2.5-0.5b")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    settings = dict(ARCHS[args.arch])
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(100, 1000, (args.batch, 40), device="cuda")
    mask = torch.ones_like(ids)
    out = {}
    for threads in (1, torch.get_num_threads()):
        torch.set_num_threads(threads)
        for cache in ("dynamic", "static"):
            gen = GenerationConfig(
                do_sample=True,
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                pad_token_id=tok.pad_token_id,
                cache_implementation=None if cache == "dynamic" else "static",
            )
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)  # warm-up
                torch.cuda.synchronize()
                t = time.perf_counter()
                model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
                torch.cuda.synchronize()
            out[f"threads={threads},cache={cache}"] = (time.perf_counter() - t) / args.new
            print(
                f"threads={threads} cache={cache}: {1000 * out[f'threads={threads},cache={cache}']:.1f} ms/step",
                flush=True,
            )
    print(json.dumps({"arch": args.arch, "batch": args.batch, "s_per_step": out}))


if __name__ == "__main__":
    main()
