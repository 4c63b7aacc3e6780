"""Small models and helpers for testing flows (public: ``flowrl.testing``).

The models use numpy only, so a replica process starts without importing torch, and they
record, per sample, which replica processed it in which round — enough to check pull
scheduling, joins and exact accounting from a flow's output alone.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ._core.flow.model import Model

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._core.flow.batch import Batch
    from ._core.settings.config import ModelConfig


class Scale(Model):
    """``dst = sum(srcs) * factor``; sleeps ``sleep_s`` per call plus ``per_sample_s`` per sample.

    Adds ``<name>_replica``, ``<name>_round`` and ``<name>_consumed`` (the replica's running
    count of samples after this call, like ChatLearn's ``consumed_samples``), and with
    ``record_gpus`` the replica's GPU ids as ``<name>_gpus``.
    """

    def __init__(
        self,
        name: str,
        config: ModelConfig | dict[str, Any] | None = None,
        *,
        srcs: Sequence[str] = ("x",),
        dst: str | None = None,
        factor: float = 1.0,
        sleep_s: float = 0.0,
        per_sample_s: float = 0.0,
        jitter_seed: int | None = None,
        record_gpus: bool = False,
    ) -> None:
        super().__init__(name, config)
        self.record_gpus = record_gpus
        self.srcs = tuple(srcs)
        self.dst = dst or f"{name}_out"
        self.factor = factor
        self.sleep_s = sleep_s
        self.per_sample_s = per_sample_s
        self.jitter_seed = jitter_seed
        self.consumed = 0

    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        time.sleep(self._delay(batch))
        total = sum(np.asarray(batch[s], dtype=np.float64) for s in self.srcs)
        self.consumed += len(batch)
        n = len(batch)
        out: dict[str, Any] = {
            self.dst: total * self.factor,
            f"{self.name}_replica": [self.replica_id] * n,
            f"{self.name}_round": [iteration] * n,
            f"{self.name}_consumed": [self.consumed] * n,
        }
        if self.record_gpus:
            out[f"{self.name}_gpus"] = [tuple(self.gpu_ids)] * n
        return out

    def set_weights(self, weights: Any) -> None:
        self.weights = dict(weights)  # a test model keeps what it was sent

    def _delay(self, batch: Batch) -> float:
        delay = self.sleep_s + self.per_sample_s * len(batch)
        if self.jitter_seed is not None:  # a per-shard random extra, so finishing order is shuffled
            rng = np.random.default_rng([self.jitter_seed, int(batch.ids[0])])
            delay += float(rng.uniform(0, 3 * max(self.sleep_s, 0.002)))
        return delay


class Fail(Model):
    """Fails when a shard contains sample ``bad_id``; otherwise adds ``<name>_ok``.

    ``how``: ``"raise"`` a ``ValueError``, ``"exit"`` the replica's process (a crash), or
    fail in ``"setup"``.
    """

    def __init__(
        self, name: str, config: ModelConfig | dict[str, Any] | None = None, *, bad_id: int = 0, how: str = "raise"
    ) -> None:
        super().__init__(name, config)
        self.bad_id = bad_id
        self.how = how

    def setup(self) -> None:
        if self.how == "setup":
            raise RuntimeError(f"cannot set up replica {self.replica_id}")

    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        if self.bad_id in batch.ids.tolist():
            if self.how == "exit":
                os._exit(3)
            raise ValueError(f"bad sample {self.bad_id}")
        return {f"{self.name}_ok": [True] * len(batch)}


class Emit(Model):
    """Returns zeros for each field with ``len(batch) + offset`` rows: for malformed-output tests."""

    def __init__(
        self, name: str, config: ModelConfig | dict[str, Any] | None = None, *, fields: dict[str, int]
    ) -> None:
        super().__init__(name, config)
        self.fields = fields  # field -> row offset (0: well formed)

    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        return {f: np.zeros(len(batch) + offset) for f, offset in self.fields.items()}


class CountingTrainer(Model):
    """A trainer that learns nothing: each step reports the sample ids and sizes it saw.

    Its weights are ``{"steps": [steps taken by this rank]}``, so a sync shows which step the
    inference replicas received.
    """

    def __init__(
        self, name: str, config: ModelConfig | dict[str, Any] | None = None, *, fail_rank: int | None = None
    ) -> None:
        super().__init__(name, config)
        self.steps = 0
        self.fail_rank = fail_rank  # this rank raises while the others wait in an all-reduce

    def train_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        self.steps += 1
        if self.fail_rank is not None:
            if self.rank == self.fail_rank:
                raise RuntimeError(f"rank {self.rank} failed")
            import torch

            self.all_reduce_grads(torch.nn.Linear(2, 1))  # blocks until every rank joins
        return {
            "ids": batch.ids.tolist(),
            "micro": [len(mb) for mb in self.micro_batches(batch)],
            "global": self.global_batch_size,
            "rank": self.rank,
            "world": self.world_size,
            "iteration": iteration,
        }

    def get_weights(self) -> dict[str, Any]:
        return {"steps": np.array([self.steps])}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def restore_state(self, state: Any) -> None:
        self.steps = state["steps"]


def flowrl_actor_names() -> list[str]:
    """Names of the live Ray actors flowrl started (empty when every pipeline is closed)."""
    from ._backends.ray_backend import live_actor_names

    return live_actor_names()
