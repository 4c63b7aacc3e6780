"""Sampling inside ``generate`` from each sample's own random stream (``Batch.generators``).

``generate(do_sample=True)`` draws every row from torch's one generator, so a row's tokens
depend on the rows beside it in the call and on the calls the replica ran before. Instead the
policy decodes greedily over logits that a processor has warped (temperature, top-k, top-p:
transformers' own warpers) and perturbed with Gumbel noise drawn from the row's generator: the
argmax of ``logits + Gumbel`` is a draw from ``softmax(logits)``, and it depends on the row
alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .config import Sampling


class RowSampler:
    """A logits processor: warps each row as sampling would, then adds the row's Gumbel noise."""

    def __init__(self, s: Sampling, generators: Sequence[torch.Generator]) -> None:
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.generators = list(generators)
        self.warpers: list[Any] = [TemperatureLogitsWarper(s.temperature)]
        if s.top_k:
            self.warpers.append(TopKLogitsWarper(s.top_k))
        if s.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(s.top_p))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        vocab = scores.shape[-1]
        uniform = torch.stack(
            [torch.rand(vocab, generator=g, device=scores.device, dtype=torch.float32) for g in self.generators]
        )
        tiny = torch.finfo(torch.float32).tiny  # log(0) would give an infinite draw
        exponential = (-torch.log(uniform.clamp(min=tiny))).clamp(min=tiny)
        gumbel = -torch.log(exponential)
        out: torch.FloatTensor = scores.float() + gumbel  # type: ignore[assignment]
        return out


def seeded(generators: Sequence[torch.Generator], seed: int) -> list[torch.Generator]:
    """``generators`` moved by ``Sampling.seed`` (0 leaves them as they are): another seed,
    other draws for the same samples."""
    if not seed:
        return list(generators)
    return [g.manual_seed(moved(g.initial_seed(), seed)) for g in generators]


def moved(stream_seed: int, seed: int) -> int:
    """A sample's stream seed moved by ``Sampling.seed`` (0 leaves it), in ``[0, 2**64)``."""
    return (int(stream_seed) + seed * 0x9E3779B97F4A7C15) % 2**64
