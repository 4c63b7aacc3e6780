"""The layout of ``examples/grpo_smollm2.py --gpu`` with a Hugging Face model of random weights
saved to a folder: the policy and its GRPO trainer colocated on one GPU (half a GPU each, weights
by CUDA IPC), a rule reward, and an evaluation pool of the policy and the reward. Shared by the
CPU test on Ray (logical GPUs) and the GPU test."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import hf_tiny

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example() -> Any:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module("grpo_smollm2")


def random_model(folder: Path, **config: Any) -> str:
    """A causal LM of random weights and the tests' tokenizer, saved in ``folder`` as a model
    folder (what ``--model`` takes); ``config`` overrides the tiny Llama's sizes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_tiny.make_tokenizer(folder)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_tiny.llama(**config))).save_pretrained(folder)
    return str(folder)


def engine(model: str, run_dir: Path, episodes: int = 1) -> Any:
    """The example's own engine with ``--gpu``: one episode and an evaluation after it."""
    ex = example()
    setup = ex.Setup()
    setup.gpu, setup.model, setup.episodes, setup.eval_every, setup.run_dir = True, model, episodes, 1, str(run_dir)
    return ex.make_engine(setup)
