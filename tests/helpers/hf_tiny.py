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
