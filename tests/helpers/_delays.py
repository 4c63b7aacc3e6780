"""Random delays injected into the tiny examples' models (issue 24's reproducibility tests)."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest


def delayed(monkeypatch: pytest.MonkeyPatch, ppo: Any, seed: int) -> None:
    """Each forward pass of ``examples/ppo_tiny.py``'s tiny models (the policy's, the
    reference's, the value's; ``grpo_tiny`` uses them too) sleeps a random 0-5 ms first, so
    shards finish in another order. In process only: Ray's workers import the module afresh."""
    rng, original = random.Random(seed), ppo.TinyLM.forward

    def slow(self: Any, *args: Any) -> Any:
        time.sleep(rng.uniform(0.0, 0.005))
        return original(self, *args)

    monkeypatch.setattr(ppo.TinyLM, "forward", slow)
