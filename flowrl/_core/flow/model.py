"""The user's model base class and step decorator.

A ``Model`` instance made on the driver is a light description (name, config, user
attributes). Inside a flow, calling one of its steps on a stage output records a stage; inside
a replica the same call runs the user's code. Each replica gets its own copy of the instance
(pickled from the driver), then ``setup()`` runs once there — build heavy state in ``setup``.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

from ..checks import field_names
from ..errors import ConfigError, FlowDefinitionError
from ..names import check_name
from ..settings.config import ModelConfig, to_config
from .node import Node, StepInfo

if TYPE_CHECKING:
    import torch

    from .batch import Batch

F = TypeVar("F", bound=Callable[..., Any])

# Methods that are steps without a decorator (ChatLearn's names).
STEP_NAMES = ("forward_step", "eval_step", "train_step")


@overload
def step(fn: F, *, reads: Iterable[str] | None = None, writes: Iterable[str] | None = None) -> F: ...
@overload
def step(
    fn: None = None, *, reads: Iterable[str] | None = None, writes: Iterable[str] | None = None
) -> Callable[[F], F]: ...
def step(
    fn: F | None = None, *, reads: Iterable[str] | None = None, writes: Iterable[str] | None = None
) -> F | Callable[[F], F]:
    """Mark a method as a step and, optionally, declare the fields it reads and writes.

    Declared fields let the flow be checked when it is built: a read nobody writes (when
    every upstream producer declares its writes, and the input fields are known) and two
    writers of one field. Declared writes are also checked against every shard's output.
    Without declarations, two writers of a field are caught when the first shard returns.
    """
    if fn is not None and not callable(fn):
        raise ConfigError(
            f"@flowrl.step decorates a method, got {type(fn).__name__}; use @flowrl.step or @flowrl.step(reads=[...])"
        )
    info = StepInfo(field_names(reads, "@flowrl.step(reads=...)"), field_names(writes, "@flowrl.step(writes=...)"))

    def mark(f: F) -> F:
        f.__flowrl_step__ = info  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def step_info(model: Model, method: str) -> StepInfo:
    info: StepInfo = getattr(getattr(type(model), method, None), "__flowrl_step__", StepInfo())
    return info


def step_target(model: Model, method: str) -> Callable[..., Any]:
    """``model.method`` as a replica calls it: the user's function itself, bound, without
    the wrapper that checks whether a flow is being traced (a replica never traces)."""
    bound = getattr(model, method)
    raw = getattr(getattr(bound, "__func__", None), "__flowrl_raw__", None)
    return bound if raw is None else types.MethodType(raw, model)


def _traceable(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    info = getattr(fn, "__flowrl_step__", StepInfo())

    @functools.wraps(fn)
    def call(self: Model, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, Node) for a in (*args, *kwargs.values())):
            if getattr(type(self), name) is getattr(Model, name, None):
                raise FlowDefinitionError(
                    f"the flow calls {self.name}.{name}, but {type(self).__name__} does not define {name}"
                )
            node = next(a for a in (*args, *kwargs.values()) if isinstance(a, Node))
            return node._builder.add_stage(self, name, args, kwargs, info)
        return fn(self, *args, **kwargs)

    call.__flowrl_step__ = info  # type: ignore[attr-defined]
    call.__flowrl_raw__ = fn  # type: ignore[attr-defined]  # what a replica calls: no tracing check
    return call


class _MissingStep(FlowDefinitionError, AttributeError):
    pass


class Model:
    """Base class of user models. Override ``setup`` and ``forward_step`` (or other steps).

    ``name``: 1 to 128 letters, digits, ``_`` and ``-`` (not starting with ``-``); it names the
    model's stages, actors and checkpoint files, so no dot, slash or space.

    Inside a replica these are set: ``name``, ``config``, ``replica_id``, ``num_replicas``,
    ``gpu_ids`` and ``node_id``; ``device`` (a property) is the ``torch.device`` to compute on:
    ``cuda`` when the replica holds a GPU and CUDA is available, else ``cpu``.

    ``auto_reduce_grads`` (a class attribute, ``True`` by default): a trainer with several
    data-parallel ranks has its gradients summed over the ranks before each step of the torch
    optimizers it holds as attributes after ``setup()``, unless ``all_reduce_grads`` already
    summed them. Set it to ``False`` in a trainer that sums them itself (DDP, or its own
    collective).

    ``merges_shards`` (a class attribute, ``False`` by default): a replica runs up to
    ``ModelConfig.prefetch`` of this model's shards at once, each step on a thread of its own,
    and takes its next shard while a step runs, for a model whose steps merge into one running
    batch (an inference engine's continuous batching, ``flowrl.vllm.VLLMPolicy``). Weights still
    load between steps, when none runs; thread-local state set in ``setup()`` is not there.
    """

    auto_reduce_grads: ClassVar[bool] = True
    merges_shards: ClassVar[bool] = False

    def __init__(self, name: str, config: ModelConfig | Mapping[str, Any] | None = None) -> None:
        self.name = check_name(name, f"{type(self).__name__}(name=...)")
        self.config: ModelConfig = to_config(ModelConfig, config, f"model {name!r} config")
        self.num_replicas = self.config.replicas
        self.replica_id: int | None = None
        self.gpu_ids: list[int] = []
        self.node_id = ""
        # trainers: this rank of the data-parallel group, and the sizes of the current step
        self.rank = 0
        self.world_size = 1
        self.global_batch_size = 0
        self.micro_batch_size = 0
        # inference models fed by a trainer: the weight version they run (0: initial weights)
        self.weight_version = 0
        self.track_version = False  # set by an engine: outputs then carry "<name>_version"
        # ids of the parameters whose gradients all_reduce_grads summed since their optimizer's
        # last step: the automatic reduction before that step leaves them alone
        self._reduced_grads: set[int] = set()
        # gradient sums over the ranks completed in this train call: none, and a call that broke
        # left the state as it was (a rank rebuilt from a survivor relies on it)
        self._grad_sums = 0
        # the engine's sync pairs this model is part of, checked by each replica after setup()
        self._sends_weights_to: tuple[str, ...] = ()
        self._receives_weights_from: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> Any:
        # Called only when the normal lookup fails. A flow calling a step the class lacks gets
        # an error naming the model; it is also an AttributeError, so hasattr() still works.
        if not (name.startswith("__") and name.endswith("__")) and not {"name", "config"} <= self.__dict__.keys():
            # copy and pickle look dunders up on a bare instance: those stay plain misses
            raise _NotInitialised(_not_initialised(type(self), name))
        if name.endswith("_step"):
            raise _MissingStep(
                f"the flow calls {self.__dict__.get('name', '?')}.{name}, but {type(self).__name__} does not "
                f"define {name}; define it as {name}(self, batch, iteration)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __deepcopy__(self, memo: dict[int, Any]) -> Model:
        # The in-process backend copies a model per replica; an attribute that cannot be copied
        # (a lock, a file, a socket made in __init__) is named, as the Ray backend's check does.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in vars(self).items():
            try:
                new.__dict__[key] = copy.deepcopy(value, memo)
            except Exception as err:
                raise ConfigError(
                    f"model {self.__dict__.get('name', '?')!r} ({type(self).__name__}) cannot be copied to its "
                    f"replicas: its attribute {key!r} ({type(value).__name__}) cannot be copied "
                    f"({type(err).__name__}: {err}); build it in setup(), which runs inside each replica"
                ) from err
        return new

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for attr, value in list(vars(cls).items()):
            if callable(value) and (attr in STEP_NAMES or hasattr(value, "__flowrl_step__")):
                setattr(cls, attr, _traceable(value, attr))

    @property
    def device(self) -> torch.device:
        """The ``torch.device`` this replica computes on (imports torch on first use)."""
        import torch

        return torch.device("cuda" if self.gpu_ids and torch.cuda.is_available() else "cpu")

    def setup(self) -> None:
        """Runs once inside each replica before its first step."""

    def begin_shard(self, batch: Batch) -> None:
        """Called once a call, with the whole shard, before its micro-batches' steps (nothing by
        default): work that they share and that a call pays once, such as one request to a
        remote scorer for the shard, or moving its inputs to the device. The ``cost`` splitter
        measures this time apart from the steps and puts more micro-batches in a shard as it
        grows (``ModelConfig.shard_micro_batches``)."""

    # A step has two call forms: a flow calls it on stage outputs and gets the new stage's output
    # (a Node); a replica calls it as (batch, iteration) and gets new fields. Subclasses define
    # the second form. The base is typed loosely because an overload of both forms here would
    # make mypy reject every subclass's (narrower) definition.
    def forward_step(self, *args: Any) -> Any:
        """``forward_step(self, batch, iteration)``: return new per-sample fields for ``batch``
        (tensors with ``len(batch)`` rows, or lists)."""
        raise NotImplementedError(f"model {self.name!r} does not implement forward_step")

    # ---- training helpers (used inside train_step) ----
    def micro_batches(self, batch: Batch) -> Iterator[Batch]:
        """This rank's shard in micro-batches of ``train_micro_batch_size`` rows."""
        size = self.micro_batch_size or len(batch)
        for start in range(0, len(batch), size):
            yield batch.select(range(start, min(start + size, len(batch))))

    def all_reduce_grads(self, module: torch.nn.Module) -> None:
        """Sum gradients over the data-parallel ranks (one flat all-reduce).

        Normalise each loss by ``self.global_batch_size`` (summed over samples, not averaged
        per micro-batch) and the sum is the exact gradient of the global batch, whatever the
        shard sizes. flowrl sums them before each step of the torch optimizers the trainer
        holds (``auto_reduce_grads``); call this first when the gradients are read before the
        step (clipping) or the weights change without a torch optimizer. Gradients summed here
        are not summed again at the step.
        """
        if self.world_size <= 1:
            return
        import torch

        # Every rank must join with the same tensor, even one whose shard was empty.
        grads = []
        for p in module.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
                self._reduced_grads.add(id(p))
        sum_over_ranks(grads)
        self._grad_sums += 1

    # ---- weight hooks (trainer -> inference sync) ----
    def get_weights(self) -> Mapping[str, Any]:
        """The weights to send to the inference models this trainer feeds (default: ``self.module``).

        Runs on every data-parallel rank at once (a sharded model gathers its full weights
        collectively here); rank 0's are sent."""
        return self._module("get_weights").state_dict()

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Load weights received from a trainer (default: into ``self.module``)."""
        self._module("set_weights").load_state_dict(weights)

    def check_weights_from(self, trainer: Model) -> None:
        """Raise ``ConfigError`` when ``trainer``'s weights cannot load into this model. An
        engine calls it for each sync pair when it is built, before any replica starts
        (default: no check; the first sync finds a mismatch)."""

    # ---- checkpoint hooks (trainers) ----
    def checkpoint_state(self) -> Mapping[str, Any]:
        """What a checkpoint keeps of this trainer: runs on every data-parallel rank at once (a
        sharded model gathers collectively here); rank 0's is kept.

        Default: the state dicts of ``self.module`` and, when set, ``self.optimizer`` and
        ``self.lr_scheduler``. Values: dicts, lists, numbers, strings, arrays and tensors.
        """
        state = {"module": self._module("checkpoint_state").state_dict()}
        for attr in ("optimizer", "lr_scheduler"):
            part = getattr(self, attr, None)
            if part is not None:
                state[attr] = part.state_dict()
        return state

    def restore_state(self, state: Mapping[str, Any]) -> None:
        """Load what ``checkpoint_state`` returned (runs after ``setup``, on every rank)."""
        self._module("restore_state").load_state_dict(state["module"])
        for attr in ("optimizer", "lr_scheduler"):
            if attr in state:
                getattr(self, attr).load_state_dict(state[attr])

    def _module(self, hook: str) -> torch.nn.Module:
        module: torch.nn.Module | None = getattr(self, "module", None)
        if module is None:
            raise NotImplementedError(
                f"model {self.name!r}: set self.module (a torch.nn.Module) in setup, or override {hook}()"
            )
        return module

    def __repr__(self) -> str:
        if not {"name", "config"} <= self.__dict__.keys():
            return f"<{type(self).__name__}, not initialised>"  # a repr must not raise
        where = "" if self.replica_id is None else f", replica {self.replica_id}/{self.num_replicas}"
        return f"{type(self).__name__}({self.name!r}{where})"


class _NotInitialised(FlowDefinitionError, AttributeError):
    pass


def _not_initialised(cls: type[Model], attr: str) -> str:
    owner = next((c for c in cls.__mro__ if "__init__" in vars(c) and c is not Model), cls)
    return (
        f"{owner.__name__}.__init__ did not call super().__init__(name, config): the flowrl.Model part of this "
        f"{cls.__name__} was never set up (no attribute {attr!r}); call super().__init__(name, config) at the "
        f"start of {owner.__name__}.__init__"
    )


def mark_synced(models: Iterable[Model], pairs: Iterable[tuple[Model, Model]]) -> None:
    """Record on each model the sync pairs it is part of (``models``: every model of the
    engine, whose earlier marks are dropped); each replica checks them after ``setup()``."""
    pairs = list(pairs)
    for m in models:
        m._sends_weights_to = tuple(t.name for s, t in pairs if s is m)
        m._receives_weights_from = tuple(s.name for s, t in pairs if t is m)


def weight_hooks_problem(model: Model) -> str | None:
    """Why the weight sync could not read or load ``model``'s weights, known right after
    ``setup()`` (instead of at the first sync, a whole episode later); None when it can."""
    cls = type(model)
    module = getattr(model, "module", None)
    checks = (
        (model._sends_weights_to, "get_weights", "sends weights to", "state_dict"),
        (model._receives_weights_from, "set_weights", "receives weights from", "load_state_dict"),
    )
    for peers, hook, verb, method in checks:
        if peers and getattr(cls, hook) is getattr(Model, hook) and not callable(getattr(module, method, None)):
            got = "no self.module" if module is None else f"self.module = {type(module).__name__}, without {method}()"
            return (
                f"model {model.name!r} {verb} {list(peers)} (Engine(sync=...)), but after setup() it has {got}; "
                f"set self.module (a torch.nn.Module) in setup(), or override {hook}() in {cls.__name__}"
            )
    return None


Model.forward_step = _traceable(Model.forward_step, "forward_step")  # type: ignore[method-assign]


def sum_over_ranks(tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` (of one dtype and device) over the process group in place: one flat
    all-reduce rather than one collective per tensor."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
