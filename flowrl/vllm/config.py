"""How a policy's vLLM engine is built (a frozen Struct; a run file gives it as a mapping
under the model's ``args``)."""

from __future__ import annotations

from typing import Any

import msgspec

from .._core.checks import positive, struct_types
from .._core.errors import ConfigError
from .._core.settings.base import Settings

# the engine arguments flowrl.vllm sets, and where each comes from
OWNED = {
    "model": "LM.path",
    "tokenizer": "LM.tokenizer",
    "dtype": "LM.dtype",
    "trust_remote_code": "LM.trust_remote_code",
    "seed": "each request's own seed",
    "skip_tokenizer_init": "the policy tokenizes",
    "logprobs_mode": "the trainer's kind of log-probs",
    "enable_sleep_mode": "VLLMConfig.sleep",
    "max_model_len": "VLLMConfig.max_model_len",
    "max_num_seqs": "VLLMConfig.max_num_seqs",
    "enforce_eager": "VLLMConfig.enforce_eager",
    "gpu_memory_utilization": "VLLMConfig.gpu_memory_utilization",
}


class VLLMConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """The engine inside each replica of a ``VLLMPolicy``.

    ``gpu_memory_utilization``: the share of the GPU's memory the engine may take for its
    weights, activations and KV cache (leave room for the models sharing the GPU).
    ``max_model_len``: the longest prompt plus response (None: the prompt budget plus
    ``Sampling.max_response_tokens``, capped by the model's context). ``max_num_seqs``: the
    requests the engine runs at once. ``enforce_eager``: no CUDA graphs and no compilation (a
    faster start, slower decoding; None: on the CPU only). ``sleep``: release the KV cache
    (level 1; level 2 also the weights) after each call, so that trainers on the same GPU can
    use the memory; the engine wakes before its next call. ``batch_invariant``: vLLM's
    batch-invariant kernels, where the installed version has them (the same tokens for a
    request whatever its batch). ``logprobs``: return each sampled token's log-prob (the field
    ``logprobs``); False leaves the field out and the engine skips computing it (1.24x the
    tokens/s at 1,024 prompts on an H200, docs/vllm.md); the trainer then computes its own
    (GRPO with ``old_logprobs="recompute"`` and no ``tis_cap``; PPO's rewards need them).
    ``cpu_kv_cache_gb``: the KV cache of an engine on the CPU (GiB).
    ``engine_args``: further ``vllm.LLM`` arguments, as they are (e.g.
    ``{"enable_prefix_caching": false}``).
    """

    gpu_memory_utilization: float = 0.3
    max_model_len: int | None = None
    max_num_seqs: int = 256
    enforce_eager: bool | None = None
    sleep: int = 0
    batch_invariant: bool = False
    logprobs: bool = True
    cpu_kv_cache_gb: int = 1
    engine_args: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        struct_types(self)
        positive(
            "VLLMConfig",
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            cpu_kv_cache_gb=self.cpu_kv_cache_gb,
        )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"VLLMConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.sleep not in (0, 1, 2):
            raise ConfigError(
                f"VLLMConfig.sleep must be 0 (never), 1 (release the KV cache) or 2 (and the weights), got {self.sleep}"
            )
        taken = sorted(OWNED.keys() & self.engine_args.keys())
        if taken:
            where = "; ".join(f"{key}: {OWNED[key]}" for key in taken)
            raise ConfigError(f"VLLMConfig.engine_args={self.engine_args!r}: {taken} are set elsewhere ({where})")
