"""``hf_lengths.LengthPolicy``'s counterpart on a vLLM engine, for ``seed_ppo.py --engine vllm``:
each response is exactly its sample's ``target`` + 1 tokens long (``min_tokens`` = ``max_tokens``:
the length LengthPolicy's forced eos gives), with the same per-sample report fields. The engine
pads nothing (a request leaves the batch when it ends), so ``waste`` is 0 and ``steps`` is the
call's longest response."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flowrl.vllm import VLLMPolicy

if TYPE_CHECKING:
    import flowrl
    from flowrl import hf


class VLLMLengthPolicy(VLLMPolicy):
    def request_params(self, s: hf.Sampling, batch: flowrl.Batch) -> list[dict[str, Any]]:
        targets = np.minimum(np.asarray(batch["target"]) + 1, s.max_new_tokens)
        return [{"min_tokens": int(t), "max_tokens": int(t)} for t in targets]

    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        out = dict(super().forward_step(batch, iteration))
        lengths = torch.tensor([len(r) for r in out["response_ids"]], dtype=torch.long)
        out["tokens"] = lengths
        out["steps"] = torch.full((len(batch),), int(lengths.max()), dtype=torch.long)
        out["waste"] = torch.zeros(len(batch), dtype=torch.long)
        out["call_rows"] = torch.full((len(batch),), len(batch), dtype=torch.long)
        return out
