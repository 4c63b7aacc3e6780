"""Generation with vLLM against Hugging Face ``generate``, side by side in one process, through
flowrl's two policies (``flowrl.vllm.VLLMPolicy``, ``flowrl.hf.HFPolicy``) on the same prompts;
then a trainer's weights into the engine, and the engine's sleep and wake-up.

Per ``--arch`` (random weights of a real architecture, or ``smollm2`` for SmolLM2-135M's real
weights from ``--smollm2`` (a model folder)): ``--prompts`` prompts, ``--new`` new tokens each
(random weights rarely stop early), temperature 1. Each policy runs the batch once to warm up,
then ``--repeats`` times timed: generated tokens/s and nvidia-smi's utilization (median) during
the timed calls. Weight sync: a float32 copy of the model on the GPU (a trainer's) loaded into
the engine ``--repeats`` times (seconds each). With ``--sleep 1`` (or 2) the engine rests after
each call, as when it shares the GPU with trainers (the timed calls then include waking up):
the GPU memory it frees, and the seconds of waking up and going back to sleep.

    python3 benchmarks/gpu/vllm_rollout.py --tokenizer T --arch qwen2.5-0.5b --out OUT   # the GPU
    python benchmarks/gpu/vllm_rollout.py --tokenizer T --arch tiny --prompts 8 --new 8 --out /tmp/v

Writes OUT/vllm-rollout-<arch>.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoTokenizer

if TYPE_CHECKING:
    from collections.abc import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_grpo import ARCHS, GpuBusy  # noqa: E402

import flowrl  # noqa: E402
from flowrl import hf  # noqa: E402

TINY = {  # a CPU check of the script (vLLM's CPU attention takes a head size of 32 or more)
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 49152,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
}


def make_lm(args: argparse.Namespace) -> hf.LM:
    if args.arch == "smollm2":
        return hf.LM(path=args.smollm2)
    arch = TINY if args.arch == "tiny" else ARCHS[args.arch]
    return hf.LM(config=arch, tokenizer=args.tokenizer, dtype="auto")


def words(n: int) -> list[str]:
    return [f"Count the apples: {i} red, {2 * i + 1} green and some more." for i in range(n)]


def prompts(n: int) -> flowrl.Batch:
    return flowrl.Batch(torch.arange(n), {"prompt": words(n)})


def timed(policy: Any, batch: flowrl.Batch, repeats: int, busy: GpuBusy | None) -> dict[str, Any]:
    return timed_calls(lambda: sum(len(r) for r in policy.forward_step(batch, 0)["response_ids"]), repeats, busy)


def timed_calls(call: Callable[[], int], repeats: int, busy: GpuBusy | None) -> dict[str, Any]:
    """``call`` (it returns the tokens it generated) once to warm up, then ``repeats`` times timed."""
    call()
    runs, windows = [], []
    for _ in range(repeats):
        start, wall = time.perf_counter(), time.time()
        tokens = call()
        seconds = time.perf_counter() - start
        windows.append((wall, time.time()))
        runs.append((tokens, seconds))
    result: dict[str, Any] = {
        "tokens_per_s": [round(t / s, 1) for t, s in runs],
        "seconds": [round(s, 3) for _, s in runs],
        "tokens": runs[0][0],
    }
    if busy is not None:
        result["gpu_busy"] = busy.per_gpu(windows)
    return result


def breakdown(llm: Any, prompt_ids: list[torch.Tensor], args: argparse.Namespace, busy: GpuBusy | None) -> Any:
    """The engine's own ``LLM.generate`` on the policy's prompts, without flowrl around it: with
    the requests as the policy makes them (a seed each, the sampled tokens' log-probs as flat
    lists), with the log-probs as one dict a token (vLLM's default), without the log-probs,
    and without seeds either. Against the policy's figure, what flowrl's own
    Python costs; between them, what the engine's per-token work for log-probs and seeds costs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    ids = [{"prompt_token_ids": p.tolist()} for p in prompt_ids]
    base = {"max_tokens": args.new, "temperature": 1.0, "detokenize": False}
    base["output_kind"] = RequestOutputKind.FINAL_ONLY
    variants = {
        "seeds_logprobs": lambda i: {"seed": i, "logprobs": 0, "flat_logprobs": True},  # as the policy asks
        "seeds_logprob_dicts": lambda i: {"seed": i, "logprobs": 0},
        "seeds": lambda i: {"seed": i},
        "plain": lambda i: {},
    }
    result = {}
    for name, more in variants.items():
        params = [SamplingParams(**base, **more(i)) for i in range(len(ids))]

        def call(params: list[Any] = params) -> int:
            outs = llm.generate(ids, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        result[name] = timed_calls(call, args.repeats, busy)
        print(name, json.dumps(result[name]), flush=True)
    return result


def invariance(policy: Any, n: int) -> dict[str, Any]:
    """Does a sample draw the same tokens whatever call it lands in? Each sample's response in a
    call of all ``n`` prompts, against the same samples (same ids, so the same seeds) reversed,
    in a call of the first 17, and alone (the first 8, one call each): per variant the rows
    compared, the rows identical, and where a differing row first differs (token index)."""

    def responses(ids: list[int]) -> dict[int, list[int]]:
        every = words(n)
        batch = flowrl.Batch(torch.tensor(ids), {"prompt": [every[i] for i in ids]})
        out = policy.forward_step(batch, 0)["response_ids"]
        return {i: [int(t) for t in r] for i, r in zip(ids, out, strict=True)}

    full = responses(list(range(n)))
    variants = {
        "reversed": responses(list(range(n))[::-1]),
        "first_17": responses(list(range(min(17, n)))),
        "alone": {k: v for i in range(min(8, n)) for k, v in responses([i]).items()},
    }
    result: dict[str, Any] = {}
    for name, got in variants.items():
        firsts = [
            next((j for j, (a, b) in enumerate(zip(full[i], r, strict=False)) if a != b), min(len(full[i]), len(r)))
            for i, r in got.items()
            if full[i] != r
        ]
        result[name] = {"rows": len(got), "identical": len(got) - len(firsts), "first_difference_at": sorted(firsts)}
    return result


def own_process(args: argparse.Namespace, busy: GpuBusy | None) -> dict[str, Any]:
    """``breakdown`` with vLLM's usual layout: the engine core in a process of its own, the
    Python that feeds it and collects its outputs in this one, so that the two overlap."""
    from vllm import LLM

    from flowrl.vllm import engine_folder

    folder, tokenizer = engine_folder(make_lm(args)).path, AutoTokenizer.from_pretrained(args.tokenizer)
    ids = [torch.tensor(tokenizer(w)["input_ids"]) for w in words(args.prompts)]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    # this process has touched CUDA (the model folder, the GPU sampler): a forked core cannot use it
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    start = time.perf_counter()
    llm = LLM(
        model=str(folder),
        tokenizer=args.tokenizer,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        gpu_memory_utilization=args.memory,
        logprobs_mode="processed_logprobs",
    )
    return {"start_s": round(time.perf_counter() - start, 1), "engine_alone": breakdown(llm, ids, args, busy)}


def weight_sync(policy: Any, lm: hf.LM, repeats: int) -> dict[str, Any]:
    """A trainer's float32 weights on the same device, into the engine."""
    trainer = hf.HFModel("trainer", lm=lm)
    trainer.gpu_ids = policy.gpu_ids
    trainer.setup()
    weights = {k: v.float() for k, v in trainer.module.state_dict().items()}
    seconds = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        policy.set_weights(weights)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(round(time.perf_counter() - start, 4))
    params = sum(v.numel() for v in weights.values())
    del trainer, weights
    return {"seconds": seconds, "median_s": statistics.median(seconds), "parameters": params}


def sleep_wake(policy: Any) -> dict[str, Any]:
    """With ``VLLMConfig.sleep`` on, the engine rests after each call: the GPU memory it frees
    (free memory asleep, less awake) and the seconds of waking up and of going back to sleep."""
    if not torch.cuda.is_available():
        return {"skipped": "no GPU (sleep is a no-op on the CPU)"}
    if not policy.engine_config.sleep:
        return {"skipped": "--sleep 0: the engine has no sleep mode"}
    free_asleep = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    policy.wake()
    woke = time.perf_counter() - start
    free_awake = torch.cuda.mem_get_info()[0]
    start = time.perf_counter()
    policy.rest()
    slept = time.perf_counter() - start
    return {
        "level": policy.engine_config.sleep,
        "freed_gib": round((free_asleep - free_awake) / 2**30, 2),
        "wake_s": round(woke, 3),
        "sleep_s": round(slept, 3),
    }


def model_arguments(parser: argparse.ArgumentParser, prompts: int) -> None:
    """The model and the rollout's shape, as make_lm, words and timed_calls read them."""
    parser.add_argument("--arch", default="qwen2.5-0.5b", help=f"tiny, smollm2 or one of {sorted(ARCHS)}")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct's model folder (--arch smollm2)")
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(parser, prompts=256)
    parser.add_argument("--memory", type=float, default=0.3, help="VLLMConfig.gpu_memory_utilization")
    parser.add_argument("--sleep", type=int, default=0, help="VLLMConfig.sleep (1, 2: each call wakes and rests)")
    parser.add_argument("--engine-args", default="{}", help="VLLMConfig.engine_args as JSON")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--breakdown", action="store_true", help="also the engine's own generate (see breakdown)")
    parser.add_argument("--own-process", action="store_true", help="only the breakdown, engine in its own process")
    parser.add_argument("--invariance", type=int, default=0, help="only the batch-invariance check, of N prompts")
    parser.add_argument("--batch-invariant", action="store_true", help="VLLMConfig.batch_invariant")
    parser.add_argument("--no-logprobs", action="store_true", help="VLLMConfig.logprobs=False")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.own_process:
        record = {"arch": args.arch, "prompts": args.prompts, "new": args.new} | own_process(
            args, GpuBusy() if torch.cuda.is_available() else None
        )
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"vllm-own-process-{args.arch}.json").write_text(json.dumps(record, indent=1))
        print(json.dumps(record), flush=True)
        return
    from flowrl.vllm import VLLMPolicy

    cuda = torch.cuda.is_available()
    lm, batch = make_lm(args), prompts(args.prompts)
    sampling = {"max_new_tokens": args.new, "temperature": 1.0, "chat_template": False}
    busy = GpuBusy() if cuda else None
    record: dict[str, Any] = {"arch": args.arch, "prompts": args.prompts, "new": args.new, "cuda": cuda}
    record |= {"sleep": args.sleep, "engine_args": json.loads(args.engine_args), "logprobs": not args.no_logprobs}
    start = time.perf_counter()
    fast = VLLMPolicy(
        "vllm",
        lm=lm,
        sampling=sampling,
        engine={
            "gpu_memory_utilization": args.memory,
            "max_num_seqs": max(256, args.prompts),  # every prompt in the running batch at once
            "sleep": args.sleep,
            "engine_args": json.loads(args.engine_args),
            "batch_invariant": args.batch_invariant,
            "logprobs": not args.no_logprobs,
        },
    )
    fast.gpu_ids = [0] if cuda else []
    fast.setup()
    record["vllm_start_s"] = round(time.perf_counter() - start, 1)
    if args.invariance:
        record |= {"batch_invariant": args.batch_invariant, "invariance": invariance(fast, args.invariance)}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"vllm-invariance-{args.arch}{'-batch-invariant' if args.batch_invariant else ''}.json"
        (out / name).write_text(json.dumps(record, indent=1))
        print(json.dumps(record), flush=True)
        return
    record["vllm"] = timed(fast, batch, args.repeats, busy)
    print(json.dumps(record), flush=True)
    if args.breakdown:
        ids = fast.prompts(batch, fast.max_prompt, "max_new_tokens")
        fast.wake()  # the engine rests between calls with --sleep: generate needs it awake
        record["engine_alone"] = fast.loop.use(lambda _: breakdown(fast.llm, ids, args, busy))
        fast.rest()
    record["weight_sync"] = weight_sync(fast, lm, args.repeats)
    record["sleep_wake"] = sleep_wake(fast)
    print(json.dumps(record), flush=True)
    if not args.skip_hf:
        slow = hf.HFPolicy("hf", lm=fast.served, sampling=sampling)  # the engine's own folder: the same weights
        slow.gpu_ids = fast.gpu_ids
        slow.setup()
        record["hf"] = timed(slow, batch, 1, busy)
        record["speedup"] = round(
            statistics.median(record["vllm"]["tokens_per_s"]) / statistics.median(record["hf"]["tokens_per_s"]), 1
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"vllm-rollout-{args.arch}.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
