"""Hugging Face language models as flowrl models (``pip install flowrl[hf]``).

Ready-made ``flowrl.Model`` classes over ``transformers`` causal LMs: ``HFPolicy`` samples
responses with a KV cache and records their log-probs, ``HFReference`` scores given responses,
``HFValue`` and ``HFRewardModel`` add a value head and a sequence classifier, ``RuleReward``
runs a Python function over the decoded text (verifiable rewards). ``GRPOTrainer``,
``PPOTrainer`` and ``ValueTrainer`` train the same networks on data-parallel ranks, with the
losses of ``flowrl.rl``. ``LM`` says where a model comes from; ``Sampling``, ``Optim``,
``Train``, ``GRPO`` and ``PPO`` how it samples and trains; ``convert_gguf`` turns a GGUF
checkpoint into a plain model folder once. See docs/hf.md.
"""

from __future__ import annotations

from .config import GRPO, LM, PPO, Optim, Sampling, Train
from .convert import cache_folder, convert_gguf
from .models import HFModel, HFPolicy, HFReference, HFRewardModel, HFValue, RuleReward
from .tokens import Padded, join, left_pad, right_pad, sequence_logprobs, token_logprobs
from .trainers import GRPOTrainer, HFTrainer, PPOTrainer, ValueTrainer

__all__ = [
    "GRPO",
    "LM",
    "PPO",
    "GRPOTrainer",
    "HFModel",
    "HFPolicy",
    "HFReference",
    "HFRewardModel",
    "HFTrainer",
    "HFValue",
    "Optim",
    "PPOTrainer",
    "Padded",
    "RuleReward",
    "Sampling",
    "Train",
    "ValueTrainer",
    "cache_folder",
    "convert_gguf",
    "join",
    "left_pad",
    "right_pad",
    "sequence_logprobs",
    "token_logprobs",
]
