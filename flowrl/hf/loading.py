"""Tokenizers and ``transformers`` models from an ``LM``, with errors that name the model and
the setting at fault."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import torch

from .._core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .config import LM

Head = Literal["causal", "value", "reward"]


def checked_paths(lm: LM, model: str) -> LM:
    """``lm`` with its folders made absolute; fails on the driver, before any replica starts,
    when a named file is not there. Replicas run in other working folders, and a relative
    path that does not resolve there would be taken for a hub name."""
    for key, value in (("path", lm.path), ("tokenizer", lm.tokenizer)):
        if value is not None and not Path(value).is_dir():
            raise ConfigError(f"model {model!r}: LM.{key}={value!r} is not a folder (flowrl.hf loads local files only)")
    if lm.gguf_file is not None:
        where = Path(lm.path or ".") / lm.gguf_file
        if not where.is_file():
            raise ConfigError(f"model {model!r}: LM.gguf_file={lm.gguf_file!r}: no file {where}")
    absolute = {k: str(Path(v).resolve()) for k, v in (("path", lm.path), ("tokenizer", lm.tokenizer)) if v}
    return msgspec.structs.replace(lm, **absolute)


def dtype_of(lm: LM, device: torch.device) -> torch.dtype:
    if lm.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[lm.dtype]


def load_tokenizer(lm: LM, model: str) -> PreTrainedTokenizerBase:
    """The tokenizer, with a pad token (the tokenizer's own or ``LM.pad_token``)."""
    from transformers import AutoTokenizer

    where = lm.tokenizer or lm.path
    kwargs: dict[str, Any] = {"trust_remote_code": lm.trust_remote_code, "local_files_only": True}
    if lm.gguf_file is not None and lm.tokenizer is None:
        kwargs["gguf_file"] = lm.gguf_file
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    if lm.pad_token is not None:
        tokenizer.pad_token = lm.pad_token
    if tokenizer.pad_token_id is None:
        raise ConfigError(
            f"model {model!r}: the tokenizer at {where!r} has no pad token; set LM.pad_token "
            f"(its eos token is {tokenizer.eos_token!r})"
        )
    return tokenizer


def load_module(lm: LM, head: Head, device: torch.device, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    """The network for ``head`` on ``device``: a causal LM, a causal LM's body with a scalar
    value head, or a sequence classifier with one label (a reward model)."""
    import transformers as tf

    dtype = dtype_of(lm, device)
    if head == "value":
        body = _pretrained(tf.AutoModel, lm, dtype) if lm.path else random_model(tf.AutoModel, lm, dtype, tokenizer)
        module: torch.nn.Module = ValueModel(body)
    else:
        auto = tf.AutoModelForCausalLM if head == "causal" else tf.AutoModelForSequenceClassification
        extra = {"num_labels": 1} if head == "reward" else {}
        module = _pretrained(auto, lm, dtype, **extra) if lm.path else random_model(auto, lm, dtype, tokenizer, **extra)
        if head == "reward":
            module.config.pad_token_id = tokenizer.pad_token_id
    return module.to(device=device, dtype=dtype)


def _pretrained(auto: Any, lm: LM, dtype: torch.dtype, **extra: Any) -> PreTrainedModel:
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": lm.trust_remote_code, "local_files_only": True}
    kwargs.update(extra)
    if lm.gguf_file is not None:
        kwargs["gguf_file"] = lm.gguf_file
    model: PreTrainedModel = auto.from_pretrained(lm.path, **kwargs)
    return model


def random_model(
    auto: Any, lm: LM, dtype: torch.dtype, tokenizer: PreTrainedTokenizerBase, **extra: Any
) -> PreTrainedModel:
    from transformers import AutoConfig

    assert lm.config is not None
    # the special tokens are the tokenizer's, not a config class's defaults (which name other tokens)
    special = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    settings = {**special, **lm.config}
    config = AutoConfig.for_model(str(settings.pop("model_type")), **settings, **extra)
    # every replica and trainer rank draws the same initial weights, from a generator of their
    # own: the process's stays as it was (each policy replica samples from its own seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lm.seed)
        model: PreTrainedModel = auto.from_config(config, dtype=dtype)
    return model


class ValueModel(torch.nn.Module):
    """A causal LM's body and a linear head: one value per position, ``[n, T]``."""

    def __init__(self, body: Any) -> None:  # a transformers base model
        super().__init__()
        self.body = body
        hidden = int(body.config.hidden_size)
        self.head = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.head.weight)  # start at value 0 everywhere: no initial bias
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        out: torch.Tensor = self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)
        return out


def context_length(module: torch.nn.Module) -> int | None:
    config = getattr(module, "config", None) or getattr(getattr(module, "body", None), "config", None)
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if value else None


SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def shape_of(lm: LM) -> dict[str, object]:
    """The settings that decide a model's weight names and shapes (read from its config)."""
    from transformers import AutoConfig

    if lm.config is not None:
        settings = dict(lm.config)
        config = AutoConfig.for_model(str(settings.pop("model_type")), **settings)
        return {key: getattr(config, key, None) for key in SHAPE_KEYS}
    folder = str(lm.path)  # a hub-style name in the local cache has no file here: stamp 0
    source = Path(folder, lm.gguf_file or "config.json")
    stamp = source.stat().st_mtime_ns if source.exists() else 0
    return dict(_file_shape(folder, lm.gguf_file, lm.trust_remote_code, stamp))


@functools.lru_cache(maxsize=64)
def _file_shape(path: str, gguf_file: str | None, trust: bool, stamp: int) -> tuple[tuple[str, object], ...]:
    """Read once per file and version (``stamp``): a GGUF file's config is parsed from its whole
    metadata, seconds for a small model, and every sync pair's check asks for it."""
    from transformers import AutoConfig

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust, local_files_only=True, **extra)
    return tuple((key, getattr(config, key, None)) for key in SHAPE_KEYS)
