"""What runs inside a trainer rank, whatever the backend: set-up and the group's process
group, train steps over micro-batches with the gradients summed across ranks, the ranks'
weights compared after the first step, weights out (host, CUDA IPC, NCCL), checkpoint state."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._core.errors import CheckpointError, FlowError, OutputError, StageError
from .._core.training.rng_state import rng_state, set_rng_state
from .._core.training.state_format import decode_state, encode_state
from .determinism import use_deterministic_torch
from .grad_sync import GradReducer, check_scaler, checksum, has_shards, unchecked
from .weight_arrays import check_weight_hooks, to_arrays, weights_of
from .weight_share import Broadcast, CudaShare, Group, Sender, on_cuda, read_all

if TYPE_CHECKING:
    from .._core.flow.batch import Batch
    from .._core.flow.model import Model

log = logging.getLogger("flowrl")


class TrainerRuntime:
    """One rank of a data-parallel trainer group."""

    def __init__(self, model: Model, rank: int, world_size: int, deterministic: bool = False) -> None:
        self.model = model
        self.deterministic = deterministic  # torch's deterministic algorithms, from setup() on
        model.rank, model.world_size, model.replica_id = rank, world_size, rank
        self._shared: tuple[CudaShare | None, CudaShare | None] = (None, None)  # weight_transport="cuda_ipc"
        self._sender = Sender()  # weight_transport="nccl"
        # several ranks: gradients summed before each optimizer step (unless the model opts out)
        self._reducer = GradReducer(model) if world_size > 1 and model.auto_reduce_grads else None
        self._compared = world_size <= 1  # the ranks' weights are compared after the first step
        # the last train call broke before any gradient sum completed: the state is the one it began with
        self._state_as_before = False

    def setup(self, init_method: str | None, gpu_ids: list[int], node_id: str, timeout_s: float) -> str:
        m = self.model
        m.gpu_ids, m.node_id = list(gpu_ids), node_id
        stage = f"{m.name}.setup"
        if self.deterministic:
            use_deterministic_torch()
        try:
            if m.world_size > 1:
                import datetime

                import torch
                import torch.distributed as dist

                backend = "nccl" if gpu_ids and torch.cuda.is_available() else "gloo"
                dist.init_process_group(
                    backend,
                    init_method=init_method,
                    rank=m.rank,
                    world_size=m.world_size,
                    timeout=datetime.timedelta(seconds=timeout_s),
                )
            m.setup()
            if self._reducer is not None:
                check_scaler(m)  # an AMP scaler would hang the gradient sum: refused before episode 0
        except Exception as err:
            raise StageError(f"{type(err).__name__}: {err}", stage, m.rank, []) from err
        check_weight_hooks(m, m.rank)
        return node_id

    def train(self, batch: Batch, step_size: int, micro_batch: int, iteration: int) -> dict[str, Any]:
        m = self.model
        m.global_batch_size, m.micro_batch_size = step_size, micro_batch
        m._reduced_grads.clear()
        m._grad_sums, self._state_as_before = 0, False
        if self._reducer is not None:
            try:
                self._reducer.attach()
            except FlowError as err:  # a GradScaler made in a train step
                raise StageError(str(err), f"{m.name}.train_step", m.rank, batch.ids.tolist()) from err
        # the first step on this group: the driver compares the ranks' weights before and after it
        extra: dict[str, Any] = {} if self._compared else {"_weights_before": checksum(m)}
        start, started = time.perf_counter(), time.time()
        try:
            out = m.train_step(batch, iteration)
        except Exception as err:
            self._state_as_before = m._grad_sums == 0
            raise StageError(
                f"{type(err).__name__}: {err}", f"{m.name}.train_step", m.rank, batch.ids.tolist()
            ) from err
        if out is not None and not isinstance(out, Mapping):
            raise OutputError(
                f"train_step must return a mapping of metrics or None, got {type(out).__name__}",
                f"{m.name}.train_step",
                m.rank,
                batch.ids.tolist(),
            )
        busy = time.perf_counter() - start
        if not self._compared:
            self._compared = True
            extra["_weights_after"] = checksum(m)
            for line in unchecked(m, self._reducer) if m.rank == 0 else []:
                log.warning("%s", line)
        if self._reducer is not None:  # the generators a rank rebuilt from a survivor starts its next call with
            extra["_rng"] = encode_state(rng_state())
        return {**(out or {}), **extra, "_busy_s": busy, "_samples": len(batch), "_started": started}

    def get_weights(self) -> dict[str, Any] | CudaShare | Broadcast | None:
        """Rank 0: the weights to send. Every rank is asked at once (a sharded model gathers
        its full weights collectively); the others' return nothing."""
        m = self.model
        if m.rank != 0:
            try:
                read_all(m.get_weights())
            except Exception as err:
                raise StageError(f"{type(err).__name__}: {err}", f"{m.name}.get_weights", m.rank, []) from err
            return None
        if m.config.weight_transport != "host":
            try:
                weights = m.get_weights()
            except Exception as err:
                raise StageError(f"{type(err).__name__}: {err}", f"{m.name}.get_weights", m.rank, []) from err
            if m.config.weight_transport == "nccl":
                return self._sender.snapshot(weights, m.name)
            if on_cuda(weights):
                # kept alive for two syncs: a replica joining while the next is read still
                # receives the one before
                self._shared = (self._shared[1], CudaShare(weights))
                return self._shared[1]
            return to_arrays(weights)  # read once: a sharded model's read is a collective
        return weights_of(m, m.rank)

    # ---- weight_transport="nccl": rank 0 broadcasts a snapshot to the replicas ----
    def serve_weights(self, address: str, world: int, backend: str, timeout_s: float) -> Group:
        return self._sender.groups.serve(address, world, backend, timeout_s)

    def send_weights(self, group: Group, snapshot: int, keep: list[str]) -> None:
        try:
            self._sender.send(group, snapshot, keep)
        except Exception as err:
            raise StageError(f"{type(err).__name__}: {err}", f"{self.model.name}.weight broadcast", 0, []) from err

    def weight_values(self, snapshot: int) -> dict[str, Any]:
        return self._sender.values(snapshot)

    def save_state(self, alone: bool = False) -> tuple[bytes | None, bytes]:
        """(rank 0: the model's ``checkpoint_state``; else None, this rank's random generators).
        ``alone``: this rank's own state, read after a peer died, when its gradients are summed by
        flowrl, nothing is sharded and its last train call broke before any gradient sum, so
        that the state is the one that call began with; else None (and so before its first
        call: its generators alone)."""
        m = self.model
        stage = f"{m.name}.checkpoint_state"
        if alone and not (self._reducer is not None and self._state_as_before and not has_shards(m)):
            return None, encode_state(rng_state())
        try:  # on every rank at once (unless alone): a sharded model gathers its state collectively
            state = m.checkpoint_state()
        except Exception as err:
            raise StageError(f"{type(err).__name__}: {err}", stage, m.rank, []) from err
        if m.rank != 0 and not alone:
            return None, encode_state(rng_state())
        try:
            return encode_state(state), encode_state(rng_state())
        except CheckpointError as err:
            raise StageError(str(err), stage, m.rank, []) from err

    def load_state(self, model: bytes, rng: bytes | None) -> None:
        m = self.model
        try:
            m.restore_state(decode_state(model))
        except Exception as err:
            raise StageError(f"{type(err).__name__}: {err}", f"{m.name}.restore_state", m.rank, []) from err
        if rng is not None:
            set_rng_state(decode_state(rng))
