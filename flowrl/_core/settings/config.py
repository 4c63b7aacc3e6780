"""Configuration and control messages: frozen, keyword-only msgspec Structs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

import msgspec

from ..checks import at_most, non_negative, one_of, positive, struct_types
from ..errors import ConfigError
from .base import Settings, moved_hint
from .healing import Healing

SplitterName = Literal["cost", "guided", "factoring", "greedy"]
BackendName = Literal["ray", "inprocess"]
WeightTransport = Literal["host", "cuda_ipc", "nccl"]
OnTimeout = Literal["fail", "retry"]
OnSpent = Literal["fail", "drop"]
S = TypeVar("S", bound=msgspec.Struct)


# Shards in flight per replica: each one is a slot the scheduler keeps and loops over, so a huge
# number never ends its set-up loop (an in-process engine or the simulator hangs). One running and
# one waiting hide a call's latency; more than a few hundred only queue work a replica cannot start.
MAX_PREFETCH = 256
# Autoscale measures the pools every ``every_s``: below 10 ms the driver's event loop would spend
# itself measuring (a busy loop), and no pool grows or shrinks that fast anyway.
MIN_EVERY_S = 0.01


class Autoscale(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """Grow and shrink one model's pool while runs go on, between ``min_replicas`` and
    ``max_replicas`` and within the cluster's free resources.

    Every ``every_s`` seconds of an active run the pool is measured. It grows when the
    samples waiting for its stages stay at least ``grow_queue`` batches per serving replica,
    and shrinks when its replicas spent at least ``shrink_starved`` of the time with no shard,
    each for ``patience`` measurements in a row.
    """

    min_replicas: int = 1
    max_replicas: int
    grow_queue: float = 1.0
    shrink_starved: float = 0.5
    patience: int = 2
    every_s: float = 0.5

    def __post_init__(self) -> None:
        struct_types(self)
        positive(
            "Autoscale",
            min_replicas=self.min_replicas,
            max_replicas=self.max_replicas,
            grow_queue=self.grow_queue,
            patience=self.patience,
            every_s=self.every_s,
        )
        if self.every_s < MIN_EVERY_S:
            raise ConfigError(
                f"Autoscale.every_s must be >= {MIN_EVERY_S} s (a shorter period polls the pools in a busy "
                f"loop), got {self.every_s!r}"
            )
        if self.max_replicas < self.min_replicas:
            raise ConfigError(f"Autoscale.max_replicas={self.max_replicas} is below min_replicas={self.min_replicas}")
        if not 0 < self.shrink_starved <= 1:
            raise ConfigError(
                f"Autoscale.shrink_starved must be in (0, 1] (a fraction of the time), got {self.shrink_starved}"
            )


class CallCostPrior(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """What a call of the model is expected to cost before any call has been measured (the
    ``cost`` splitter's start): ``fixed_s`` whatever the call's size (a kernel launch, padding
    to a shape, a micro-batch), plus ``per_sample_s`` for each sample. Measured calls replace it."""

    fixed_s: float = 0.0
    per_sample_s: float = 0.0

    def __post_init__(self) -> None:
        struct_types(self)
        non_negative("CallCostPrior", fixed_s=self.fixed_s, per_sample_s=self.per_sample_s)
        at_most("CallCostPrior", 1e9, "seconds", fixed_s=self.fixed_s, per_sample_s=self.per_sample_s)


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """How one model runs: replica count, per-call batch size, resources, splitter policy.

    ``batch_size``: the most samples a step takes at once (a micro-batch). A shard may hold up
    to ``shard_micro_batches`` (8) of them: its replica runs them one after the other in one
    call, so a call's fixed cost (dispatch and transport; the model's ``begin_shard``) is paid
    once for them all. The ``cost`` splitter picks the shard's size within that from the calls
    it measures, several micro-batches only while calls last as predicted; the other splitters
    cut at most one micro-batch. 1 keeps one micro-batch a shard.

    The replica count is either ``num_replicas`` or, ChatLearn-style, ``num_gpu`` divided by
    ``tensor_parallel_size * pipeline_parallel_size``. Give one or both (they must agree).
    ``gpus_per_replica`` overrides the GPUs each replica asks Ray for (default: the parallel
    size with ``num_gpu``, else 0); a fraction lets several models share (colocate on) GPUs.
    ``call_timeout_s``: the longest a call may take, seen from the driver (a shard sent while
    others are in flight on its replica gets as long again for each); a later reply fails the run, unless
    ``on_timeout="retry"``: the replica is stopped and replaced, and the call's samples go to
    another replica (a stuck environment or tool; ``PipelineConfig.max_retries`` bounds how
    often a sample is sent again). ``on_spent``: what a sample whose call on this model's stages
    hung (or lost its replica) once more after ``max_retries`` retries does: ``"fail"`` the run,
    or ``"drop"`` the sample alone (the run goes on with the others; ``PipelineStats.dropped``
    records it, with the stage, the turn and the reason).
    ``autoscale``: grow and shrink the pool from its measured queue and starvation.
    ``healing``: a replica that dies is replaced, so that the pool keeps its size (``Healing``:
    restarts in a row per replica, per minute, backoff); None leaves it out and the pool runs
    smaller.
    ``splitter``: how shards are cut; ``cost`` (the default) learns a call's fixed and per-sample
    cost and sizes shards to finish soonest, ``call_cost`` seeding it (see concepts.md).
    ``weight_transport`` (trainers): ``"host"`` sends weights as numpy arrays through Ray's
    object store; ``"cuda_ipc"`` sends handles to a GPU snapshot, which replicas on the same
    GPU copy on the GPU (colocated models; weights that are not CUDA tensors go by host);
    ``"nccl"`` broadcasts a snapshot from rank 0 to the replicas in a process group of their own
    (NCCL for CUDA weights, on other GPUs than the trainer's; gloo for CPU weights).
    """

    num_replicas: int | None = None
    num_gpu: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    batch_size: int = 1
    shard_micro_batches: int = 8
    gpus_per_replica: float | None = None
    cpus_per_replica: float = 1.0
    splitter: SplitterName = "cost"
    call_cost: CallCostPrior | None = None
    prefetch: int = 2
    call_timeout_s: float | None = None
    on_timeout: OnTimeout = "fail"
    on_spent: OnSpent = "fail"
    autoscale: Autoscale | None = None
    healing: Healing | None = msgspec.field(default_factory=Healing)
    weight_transport: WeightTransport = "host"

    def __post_init__(self) -> None:
        one_of("ModelConfig", "splitter", self.splitter, SplitterName)
        one_of("ModelConfig", "weight_transport", self.weight_transport, WeightTransport)
        one_of("ModelConfig", "on_timeout", self.on_timeout, OnTimeout)
        one_of("ModelConfig", "on_spent", self.on_spent, OnSpent)
        struct_types(self)
        positive(
            "ModelConfig",
            num_replicas=self.num_replicas,
            num_gpu=self.num_gpu,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            batch_size=self.batch_size,
            shard_micro_batches=self.shard_micro_batches,
            prefetch=self.prefetch,
            call_timeout_s=self.call_timeout_s,
        )
        non_negative("ModelConfig", gpus_per_replica=self.gpus_per_replica, cpus_per_replica=self.cpus_per_replica)
        at_most("ModelConfig", MAX_PREFETCH, "shards in flight per replica", prefetch=self.prefetch)
        if self.num_gpu is not None:
            per = self.tensor_parallel_size * self.pipeline_parallel_size
            if self.num_gpu % per:
                below = self.num_gpu // per * per
                valid = [n for n in (below, below + per) if n > 0]
                raise ConfigError(
                    f"ModelConfig.num_gpu={self.num_gpu} does not hold whole replicas of "
                    f"tensor_parallel_size*pipeline_parallel_size={per} GPUs; "
                    f"use a multiple of {per}, e.g. num_gpu={' or '.join(map(str, valid))}"
                )
            derived = self.num_gpu // per
            if self.num_replicas is not None and self.num_replicas != derived:
                raise ConfigError(
                    f"ModelConfig.num_replicas={self.num_replicas} disagrees with num_gpu="
                    f"{self.num_gpu} / (tensor_parallel_size*pipeline_parallel_size={per}) = "
                    f"{derived}; give one of them"
                )

        scale = self.autoscale
        if isinstance(scale, Mapping):  # ModelConfig(autoscale={...}) built directly
            scale = msgspec.convert(dict(scale), Autoscale)
            msgspec.structs.force_setattr(self, "autoscale", scale)
        if isinstance(self.healing, Mapping):
            msgspec.structs.force_setattr(self, "healing", msgspec.convert(dict(self.healing), Healing))
        if scale is not None and not scale.min_replicas <= self.replicas <= scale.max_replicas:
            raise ConfigError(
                f"ModelConfig: {self.replicas} replicas to start with, outside autoscale's "
                f"[min_replicas={scale.min_replicas}, max_replicas={scale.max_replicas}]"
            )

    @property
    def replicas(self) -> int:
        """The resolved number of replicas."""
        if self.num_replicas is not None:
            return self.num_replicas
        if self.num_gpu is not None:
            return self.num_gpu // (self.tensor_parallel_size * self.pipeline_parallel_size)
        return 1

    @property
    def replica_gpus(self) -> float:
        """GPUs each replica asks Ray for."""
        if self.gpus_per_replica is not None:
            return self.gpus_per_replica
        if self.num_gpu is not None:
            return float(self.tensor_parallel_size * self.pipeline_parallel_size)
        return 0.0


PROGRESS = ("auto", "live", "log", "off")


def check_progress(owner: str, value: str | bool) -> None:
    if not isinstance(value, bool) and value not in PROGRESS:
        raise ConfigError(f"{owner}.progress must be one of {list(PROGRESS)} (or a YAML bare off/on), got {value!r}")


class PipelineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=Settings):
    """How a pipeline runs.

    ``max_inflight`` bounds every queue of the pipeline: samples admitted from the input but
    not yet handed back to the caller never exceed it. ``cost_field`` names an input field
    holding an estimate of each sample's cost (a number, e.g. the length its response had in
    the previous epoch): every stage then takes the costliest pending samples first.
    ``local_channels`` (Ray backend): replicas on the driver's node read shards whose data is
    in the driver from a Unix socket rather than Ray actor calls, which cost far more CPU.
    ``max_retries``: how many times a sample may be sent to a stage again after the replica
    running it died; the pool carries on without that replica. 0 fails the run at once.
    ``seed``: what every sample's random streams derive from (``Batch.seeds``/``generators``);
    None: an engine's ``RunConfig.seed``, else 0. ``deterministic``: a sample's numbers do not
    depend on the layout (docs/reproducibility.md): every stage cuts its shards as fixed blocks
    of ``batch_size`` sample ids (the splitter is not used), and every replica and trainer rank
    runs torch's deterministic algorithms (in process: the whole driver process does).
    ``trace_spans``: how many of the latest shard spans the pipeline keeps for its timeline
    (``write_trace``); 0 keeps none. ``progress``: ``"auto"`` (a live table while a stream
    runs, on a terminal; else a log line per run), ``"live"``, ``"log"`` or ``"off"``.
    """

    backend: BackendName = "ray"
    ray_address: str | None = None
    ray_namespace: str = "flowrl"
    ray_init_cpus: int | None = None
    ray_init_gpus: int | None = None
    max_inflight: int = 4096
    input_chunk: int = 64
    ordered: bool = True
    setup_timeout_s: float = 300.0
    startup_report_s: float = 15.0
    inprocess_threads: bool = False
    cost_field: str | None = None
    local_channels: bool = True
    max_retries: int = 3
    seed: int | None = None
    deterministic: bool = False
    trace_spans: int = 200_000
    progress: str | bool = "auto"  # YAML reads a bare off/on as a bool: False is "off", True "live"

    def __post_init__(self) -> None:
        one_of("PipelineConfig", "backend", self.backend, BackendName)
        struct_types(self)
        positive(
            "PipelineConfig",
            max_inflight=self.max_inflight,
            input_chunk=self.input_chunk,
            setup_timeout_s=self.setup_timeout_s,
            ray_init_cpus=self.ray_init_cpus,
        )
        non_negative(
            "PipelineConfig",
            ray_init_gpus=self.ray_init_gpus,
            startup_report_s=self.startup_report_s,
            max_retries=self.max_retries,
            trace_spans=self.trace_spans,
        )
        check_progress("PipelineConfig", self.progress)


def to_config(cls: type[S], value: object, where: str) -> S:
    """Accept a config Struct or a plain mapping; unknown keys and wrong types are errors."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        try:
            return msgspec.convert(dict(value), cls)
        except msgspec.ValidationError as err:
            raise ConfigError(f"{where}: {err}{moved_hint(cls, value)}") from err
    raise ConfigError(f"{where}: expected {cls.__name__} or a mapping, got {type(value).__name__}")


# ---- control messages: what crosses the driver/replica boundary besides payload objects ----


class Piece(msgspec.Struct, frozen=True, kw_only=True):
    """Rows ``rows`` of the object ``ref`` produced by ``producer`` (a stage or the input)."""

    producer: str  # the key its rows merge under (``~field``: a loop's updated field)
    ref: Any
    rows: list[int]
    fields: list[str] | None = None  # the fields to read (None: all)


class LoopCall(msgspec.Struct, frozen=True, kw_only=True):
    """What the last stage of a loop's body is told with its shard: each sample's turn (from 1)
    and why it ends after this turn if ``until`` is false for it ("" if it may go on)."""

    until: str
    turns_field: str
    stop_field: str
    turns: list[int]
    ends: list[str]
    # per synced model: the weight version of each earlier call of it in this loop, per sample
    versions: dict[str, list[list[int]]] = {}


class ShardCall(msgspec.Struct, frozen=True, kw_only=True):
    """One shard handed to one replica: which method, which samples, where their fields live."""

    stage: str
    method: str
    iteration: int
    ids: list[int]
    pieces: list[Piece]
    updates: list[str] = []  # fields it may return although its input has them (a loop's state)
    in_loop: bool = False  # a stage inside a loop's body
    loop: LoopCall | None = None  # the last stage of a loop's body: turns, ends, ``until``
    seed: int = 0  # the run's seed, and each sample's turn of the stage's loop: its random streams
    turns: list[int] | None = None


class CallMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What a replica reports about one call; the payload stays in the object store."""

    rows: int
    fields: list[str]
    busy_s: float
    out_bytes: int = 0  # about how many bytes the new fields take
    node_id: str = ""
    started: float = 0.0  # wall-clock time the step started in the replica (its timeline span)
    step_s: float = 0.0  # the step alone (busy_s also counts gathering the input)
    # field -> (kind, dtype, trailing shape): the driver checks each stage keeps them (batch.FieldTypes)
    types: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    stops: list[str] = []  # the last stage of a loop's body: why each sample leaves it ("" if it goes on)
    version: int = -1  # the weights' version the step ran with (a synced model's; -1 otherwise)
    # a call of several micro-batches: each step's (samples, seconds); empty: one step, busy_s
    steps: list[tuple[int, float]] = []
    # the part of busy_s outside the steps, paid once a call on the replica: gathering the
    # input, begin_shard, joining the micro-batches' fields
    shard_s: float = 0.0


# Control messages cross process boundaries as msgpack bytes: cheaper both ways than pickling.
_ENCODER = msgspec.msgpack.Encoder()
_CALL_DECODER = msgspec.msgpack.Decoder(ShardCall)
_META_DECODER = msgspec.msgpack.Decoder(CallMeta)


def encode_message(message: ShardCall | CallMeta) -> bytes:
    return _ENCODER.encode(message)


def decode_call(data: bytes | memoryview) -> ShardCall:
    return _CALL_DECODER.decode(data)


def decode_meta(data: bytes | memoryview) -> CallMeta:
    return _META_DECODER.decode(data)
