"""The Ray actors: what runs in a replica's or a trainer rank's process.

A replica actor runs one shard at a time on its one worker thread (a second shard sent ahead
waits, and weights load between shards, before the shards waiting), whether the shard came as a Ray call or over the
replica's Unix socket (``local_channel``). It has no extra concurrency group: one costs every
call about a quarter of its throughput, and closing needs none (a killed actor fails its pings).
A model that merges shards (``Model.merges_shards``) is the exception: its actor takes
``prefetch`` Ray calls at once (``max_concurrency``), and its worker runs their steps together.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import ray

from .local_channel import ERR, OK, ReplicaWorker
from .ray_wire import answer_reply, error_blob, prepare_call, run_call
from .replica import ReplicaRuntime
from .trainer_runtime import TrainerRuntime

if TYPE_CHECKING:
    from .._core.flow.batch import Batch
    from .._core.flow.model import Model


def _where() -> tuple[int, list[int]]:
    """This actor's process and GPUs: its answer says it was scheduled (the start-up report)."""
    return os.getpid(), [int(g) for g in ray.get_gpu_ids()]


def _node_ip() -> str:
    ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # ray leaves it unannotated
    return ip


@ray.remote
class ReplicaActor:
    def __init__(self, model: Model, replica_id: int, deterministic: bool = False) -> None:
        self.runtime = ReplicaRuntime(model, replica_id, deterministic)
        # User code runs on this one thread whichever way a shard comes (a Ray call or the
        # channel): one shard at a time, weights loaded between shards, and thread-local state
        # set in setup() (torch's grad mode, the current CUDA device) still set in the steps;
        # except a model that merges shards, whose steps run on threads of their own.
        self.worker = ReplicaWorker(model.config.prefetch if model.merges_shards else 1)
        self.held: dict[int, Batch] = {}  # channel calls' outputs too big for the socket

    def where(self) -> tuple[int, list[int]]:
        return _where()

    def setup(self) -> str:
        gpu_ids = [int(g) for g in ray.get_gpu_ids()]
        node = ray.get_runtime_context().get_node_id()
        return self.worker.submit(self.runtime.setup, gpu_ids, node).result()

    @ray.method(num_returns=2)
    def run(self, blob: bytes, *stored: Any) -> tuple[bytes, Batch | None]:
        # The pieces' object references came as arguments (Ray fetched them before the call
        # started, overlapping the previous shard); small input rows came inside ``blob``.
        return self.worker.submit(run_call, self.runtime, blob, stored, shard=True).result()

    def open_channel(self, path: str, token: str) -> None:
        self.worker.connect(path, token, self._answer, self._prepare)

    def _prepare(self, seq: int, blob: bytes) -> Any:
        try:
            return prepare_call(self.runtime, blob, ())
        except Exception as err:  # answered in its turn
            return err

    def _answer(self, seq: int, prepared: Any) -> bytes:
        try:
            if isinstance(prepared, Exception):
                raise prepared
            reply, out = answer_reply(*self.runtime.step(*prepared))
        except Exception as err:
            return ERR + error_blob(err)
        if out is not None:  # the driver takes it as a Ray return value, into shared memory,
            self.held[seq] = out.copy()  # after the next step may have overwritten a buffer it reuses
        return OK + reply

    def take(self, seq: int) -> Batch:
        return self.held.pop(seq)

    @ray.method(num_returns=2)
    def get_weights(self) -> tuple[bool, Any]:
        return True, self.worker.submit(self.runtime.get_weights).result()

    def load_weights(self, version: int, weights: Any) -> None:
        # right after the shard running now, before any queued behind it: a sync waits for
        # one shard of each replica at most
        self.worker.submit(self.runtime.load_weights, version, weights, first=True).result()

    def ping(self) -> bool:
        return True


@ray.remote(concurrency_groups={"control": 1, "weights": 1})  # type: ignore[call-overload]  # ray's overloads omit it
class TrainerActor:
    def __init__(self, model: Model, rank: int, world_size: int, deterministic: bool = False) -> None:
        self.runtime = TrainerRuntime(model, rank, world_size, deterministic)

    def where(self) -> tuple[int, list[int]]:
        return _where()

    def rendezvous(self) -> str:
        with socket.socket() as sock:  # a free port on this node, for the process group
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{_node_ip()}:{port}"

    def setup(self, init_method: str | None, timeout_s: float) -> str:
        gpu_ids = [int(g) for g in ray.get_gpu_ids()]
        return self.runtime.setup(init_method, gpu_ids, ray.get_runtime_context().get_node_id(), timeout_s)

    def train(self, batch: Batch, step_size: int, micro_batch: int, iteration: int) -> dict[str, Any]:
        return self.runtime.train(batch, step_size, micro_batch, iteration)

    @ray.method(num_returns=2)
    def get_weights(self) -> tuple[bool, Any]:
        return True, self.runtime.get_weights()

    # a broadcast waits for each replica's running shard: on a thread of its own, so the next
    # train steps go on meanwhile (its snapshot is memory of its own)
    @ray.method(concurrency_group="weights")
    def serve_weights(self, world: int, backend: str, timeout_s: float) -> Any:
        return self.runtime.serve_weights(_node_ip(), world, backend, timeout_s)

    @ray.method(concurrency_group="weights")
    def send_weights(self, group: Any, snapshot: int, keep: list[str]) -> None:
        self.runtime.send_weights(group, snapshot, keep)

    def save_state(self, alone: bool = False) -> tuple[bytes | None, bytes]:
        return self.runtime.save_state(alone)

    def load_state(self, model: bytes, rng: bytes | None) -> None:
        self.runtime.load_state(model, rng)

    @ray.method(concurrency_group="control")
    def ping(self) -> bool:
        return True
