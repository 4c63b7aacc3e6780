"""Tiny Hugging Face models for tests: a BPE tokenizer trained in milliseconds on a few
sentences, and random-weight configs of real architectures (Llama, Qwen2) a few layers deep."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

WORDS = "what is one two three four five six seven eight nine ten plus minus equals the answer yes no".split()
CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(folder: Path, *, chat: bool = True, pad: bool = True) -> str:
    """A byte-level BPE tokenizer of ~300 tokens saved in ``folder`` (returned as a str)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] + [str(n) for n in range(200)]
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>" if pad else None)
    if chat:
        fast.chat_template = CHAT
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return str(folder)


def llama(vocab: int = 300, **extra: Any) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "tie_word_embeddings": True,
        **extra,
    }


def qwen2(vocab: int = 300, **extra: Any) -> dict[str, Any]:
    return {**llama(vocab), "model_type": "qwen2", "tie_word_embeddings": False, **extra}


def write_gguf(folder: Path, seed: int = 0) -> str:
    """A GGUF checkpoint (float32, with its tokenizer) of the tiny Llama with random weights from
    ``seed``, written as ``folder/tiny.gguf``; returns the file's name. As llama.cpp writes one:
    transformers reads it back, de-quantising and un-permuting its attention weights."""
    import json

    import gguf
    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tokenizer(folder / "tokenizer"))
    bpe = json.loads((folder / "tokenizer" / "tokenizer.json").read_text())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    config = AutoConfig.for_model(**llama())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    out = gguf.GGUFWriter(str(folder / "tiny.gguf"), "llama")
    out.add_context_length(config.max_position_embeddings)
    out.add_embedding_length(config.hidden_size)
    out.add_block_count(config.num_hidden_layers)
    out.add_feed_forward_length(config.intermediate_size)
    out.add_head_count(config.num_attention_heads)
    out.add_head_count_kv(config.num_key_value_heads)
    out.add_layer_norm_rms_eps(config.rms_norm_eps)
    out.add_rope_freq_base(10000.0)
    out.add_vocab_size(config.vocab_size)
    out.add_tokenizer_model("gpt2")
    out.add_token_list(tokens)
    out.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    out.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
    out.add_eos_token_id(tokenizer.eos_token_id)
    out.add_bos_token_id(tokenizer.eos_token_id)
    out.add_pad_token_id(tokenizer.pad_token_id)
    out.add_chat_template(CHAT)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for key, value in model.state_dict().items():
        if key != "lm_head.weight":  # tied to the embedding
            out.add_tensor(names.get_name(key, try_suffixes=(".weight",)), value.numpy().astype(np.float32))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return "tiny.gguf"
