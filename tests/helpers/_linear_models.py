"""A one-layer torch trainer whose weights the weight-transport tests follow across syncs."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import flowrl


class LinearTrainer(flowrl.Model):
    """Fits ``Linear(4, 1)`` to 1 by SGD from a fixed start; reports the sum of its weights."""

    def setup(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        loss = (self.module(torch.as_tensor(np.asarray(batch["x"], dtype=np.float32))).squeeze(1) - 1).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"w_sum": float(self.module.weight.detach().sum())}
