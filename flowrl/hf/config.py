"""What the Hugging Face models are built from and how they sample and train (frozen Structs;
a run file gives them as mappings under a model's ``args``)."""

from __future__ import annotations

from typing import Literal

import msgspec

from .._core.checks import non_negative, one_of, positive, struct_types
from .._core.errors import ConfigError
from .._core.settings.base import Settings

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Schedule = Literal["constant", "linear", "cosine"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
KLKind = Literal["k1", "k2", "k3", "abs"]
OldLogprobs = Literal["rollout", "recompute"]


def _within(owner: str, low: float, high: float, why: str, *, high_open: bool = False, **values: float) -> None:
    """Each value in ``[low, high]`` (``[low, high)`` with ``high_open``)."""
    for key, value in values.items():
        if not (low <= value < high if high_open else low <= value <= high):
            shown = f"[{low:g}, {high:g}{')' if high_open else ']'}"
            raise ConfigError(f"{owner}.{key} must be in {shown} ({why}), got {value!r}")


def _old_logprobs(owner: str, old: str, tis_cap: float | None) -> None:
    one_of(owner, "old_logprobs", old, OldLogprobs)
    positive(owner, tis_cap=tis_cap)
    if tis_cap is not None and old != "recompute":
        raise ConfigError(
            f"{owner}.tis_cap weighs each token by the trainer's probability over the rollout's: it needs "
            f"{owner}.old_logprobs='recompute', got {old!r}"
        )


def _constant_length(owner: str, aggregation: str, max_tokens: int | None) -> None:
    if aggregation == "seq-mean-token-sum-norm" and max_tokens is None:
        raise ConfigError(
            f"{owner}.aggregation='seq-mean-token-sum-norm' divides by a constant length: set "
            f"{owner}.max_tokens (e.g. the policy's Sampling.max_new_tokens)"
        )


class LM(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """Where a model's weights and tokenizer come from.

    ``path``: a local folder (or hub-style name already in the local cache) that
    ``from_pretrained`` reads; with ``gguf_file`` a GGUF file in that folder (de-quantised on
    load; needs the ``gguf`` package). ``config``: instead of weights, a ``transformers``
    config as a mapping (with ``model_type``), built with random weights from ``seed`` (for
    throughput runs and tests); the tokenizer then comes from ``tokenizer``. ``dtype``: the
    weights' dtype ("auto": bfloat16 on a GPU, float32 on a CPU). ``pad_token``: the token to
    pad with when the tokenizer has none (e.g. its eos token), never guessed.
    """

    path: str | None = None
    gguf_file: str | None = None
    config: dict[str, object] | None = None
    tokenizer: str | None = None
    seed: int = 0
    dtype: Dtype = "auto"
    pad_token: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        struct_types(self, own_int_range=("seed",))  # torch's seed range is its own, checked below
        one_of("LM", "dtype", self.dtype, Dtype)
        if (self.path is None) == (self.config is None):
            raise ConfigError(
                "LM: give path= (pretrained weights) or config= (a transformers config for random "
                f"weights), exactly one; got path={self.path!r}, config={'set' if self.config else None}"
            )
        if self.config is not None and "model_type" not in self.config:
            raise ConfigError(f"LM.config needs a 'model_type' key (e.g. 'llama'), got keys {sorted(self.config)}")
        if self.path is None and self.tokenizer is None:
            raise ConfigError("LM: a model built from config= needs tokenizer= (a folder with a tokenizer)")
        if not -(1 << 63) <= self.seed < 1 << 64:  # torch.manual_seed's range, checked before a replica runs it
            raise ConfigError(f"LM.seed must be in [-2**63, 2**64), torch.manual_seed's range; got {self.seed}")


class Sampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """How the policy samples: one response per sample (``RunConfig.num_samples_per_prompt``
    sets how many samples share a prompt). ``temperature=0`` is greedy. ``stop_token_ids``
    end a response besides the tokenizer's eos. ``chat_template``: render prompts with the
    tokenizer's chat template (None: when it has one); ``system_prompt`` goes first then.
    ``max_prompt_tokens``: a longer prompt is an error naming the sample (None: the model's
    context less ``max_new_tokens``). ``seed``: moves every sample's random stream (which
    derives from the run's seed, the stage, the sample and its turn: the same tokens on any
    replica and in any shard; reproducibility.md). ``max_response_tokens``:
    a partial rollout's whole response (``HFPolicy.continue_step``, which writes at most
    ``max_new_tokens`` a call; None: ``max_new_tokens``, one call)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    chat_template: bool | None = None
    system_prompt: str | None = None
    max_prompt_tokens: int | None = None
    seed: int = 0
    max_response_tokens: int | None = None

    def __post_init__(self) -> None:
        struct_types(self)
        positive(
            "Sampling",
            max_new_tokens=self.max_new_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
            max_response_tokens=self.max_response_tokens,
        )
        non_negative("Sampling", temperature=self.temperature, top_k=self.top_k)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"Sampling.top_p must be in (0, 1], got {self.top_p}")
        if any(i < 0 for i in self.stop_token_ids):
            raise ConfigError(f"Sampling.stop_token_ids must be token ids (>= 0), got {list(self.stop_token_ids)}")


class Optim(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """AdamW and its learning-rate schedule; ``total_steps`` (optimizer steps) bounds the
    linear and cosine decays (0: no decay), after ``warmup_steps`` of linear warm-up."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        struct_types(self)
        one_of("Optim", "schedule", self.schedule, Schedule)
        positive("Optim", lr=self.lr, max_grad_norm=self.max_grad_norm)
        non_negative("Optim", weight_decay=self.weight_decay, warmup_steps=self.warmup_steps)
        non_negative("Optim", total_steps=self.total_steps)
        # eps > 0 (torch takes 0, but then a parameter whose gradient is 0 divides 0 by 0: NaN)
        positive("Optim", eps=self.eps)
        betas = {"betas[0]": self.betas[0], "betas[1]": self.betas[1]}
        _within("Optim", 0.0, 1.0, "AdamW's averaging factors", high_open=True, **betas)
        _within("Optim", 0.0, 1.0, "a fraction of lr the decay ends at", min_lr_ratio=self.min_lr_ratio)
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ConfigError(
                f"Optim.schedule={self.schedule!r} decays until total_steps, which must exceed "
                f"warmup_steps={self.warmup_steps}; got total_steps={self.total_steps}"
            )


class Train(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """How a trainer steps. ``micro_batch_tokens``: the most tokens (prompt + response) a
    micro-batch holds (0: ``RunConfig.train_micro_batch_size`` rows); ``fsdp``: shard the model
    over the data-parallel ranks with FSDP2 (``"auto"``: when there is more than one rank);
    ``autocast``: bf16 autocast on a GPU ("auto") or never; ``gradient_checkpointing``:
    recompute activations in the backward pass (less memory, ~1/3 more compute);
    ``temperature``: the log-probs' temperature, the policy's sampling temperature (an engine
    checks that they agree); ``empty_cache``: after each optimizer step on a CUDA device, hand
    the blocks PyTorch's caching allocator holds unused back to the GPU
    (``torch.cuda.empty_cache()``), so that models colocated on it can use them between steps
    (otherwise the memory of a step's activations stays with the trainer's process); the next
    step allocates it again. Off by default; it does nothing on a CPU."""

    micro_batch_tokens: int = 0
    fsdp: Literal["auto", "never"] = "auto"
    autocast: Literal["auto", "never"] = "auto"
    gradient_checkpointing: bool = False
    temperature: float = 1.0
    empty_cache: bool = False

    def __post_init__(self) -> None:
        struct_types(self)
        one_of("Train", "fsdp", self.fsdp, Literal["auto", "never"])
        one_of("Train", "autocast", self.autocast, Literal["auto", "never"])
        non_negative("Train", micro_batch_tokens=self.micro_batch_tokens)
        positive("Train", temperature=self.temperature)


class GRPO(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """The GRPO objective: group-normalised advantages (``scale="none"``: not divided by the
    group's std, as Dr. GRPO), the clipped ratio (``clip_high`` for an asymmetric upper
    bound), a KL term to the reference with estimator ``kl`` and weight ``kl_coef`` (0: no
    reference needed), and the aggregation over tokens and sequences.
    ``old_logprobs``: the log-probs the ratio is taken against: ``"rollout"`` (the policy's
    ``logprobs`` field) or ``"recompute"`` (the trainer's own, in the same forward pass, before
    its step: for a policy on an inference engine, whose numbers differ from the trainer's);
    with several optimizer steps over one rollout, each step takes the weights before it, so the
    ratio is 1 at every step and only ``tis_cap`` corrects for the rollout's older weights.
    ``tis_cap``: with ``"recompute"``, each token's loss is weighted by
    ``min(exp(trainer - rollout), tis_cap)`` (``flowrl.rl.tis_weights``), None: no weights."""

    clip: float = 0.2
    clip_high: float | None = None
    kl_coef: float = 0.0
    kl: KLKind = "k3"
    scale: Literal["std", "none"] = "std"
    aggregation: Aggregation = "token-mean"
    max_tokens: int | None = None
    old_logprobs: OldLogprobs = "rollout"
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        struct_types(self)
        one_of("GRPO", "kl", self.kl, KLKind)
        one_of("GRPO", "aggregation", self.aggregation, Aggregation)
        one_of("GRPO", "scale", self.scale, Literal["std", "none"])
        positive("GRPO", clip=self.clip, clip_high=self.clip_high, max_tokens=self.max_tokens)
        non_negative("GRPO", kl_coef=self.kl_coef)
        _constant_length("GRPO", self.aggregation, self.max_tokens)
        _old_logprobs("GRPO", self.old_logprobs, self.tis_cap)


class PPO(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """The PPO objective with GAE: per-token rewards are the KL penalty (``kl_coef``, estimator
    ``kl``) plus the score at the last token; advantages by GAE(``gamma``, ``lam``) over the
    value model's estimates; clipped ratio; value loss clipped by ``value_clip``;
    ``old_logprobs`` and ``tis_cap`` as ``GRPO``'s."""

    clip: float = 0.2
    clip_high: float | None = None
    kl_coef: float = 0.05
    kl: KLKind = "k1"
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float | None = 0.2
    aggregation: Aggregation = "token-mean"
    max_tokens: int | None = None
    old_logprobs: OldLogprobs = "rollout"
    tis_cap: float | None = None

    def __post_init__(self) -> None:
        struct_types(self)
        one_of("PPO", "kl", self.kl, KLKind)
        one_of("PPO", "aggregation", self.aggregation, Aggregation)
        positive("PPO", clip=self.clip, clip_high=self.clip_high, value_clip=self.value_clip)
        non_negative("PPO", kl_coef=self.kl_coef)
        _within("PPO", 0.0, 1.0, "a discount of GAE", gamma=self.gamma, lam=self.lam)
        positive("PPO", max_tokens=self.max_tokens)
        _constant_length("PPO", self.aggregation, self.max_tokens)
        _old_logprobs("PPO", self.old_logprobs, self.tis_cap)
