"""Gradients summed over a trainer's data-parallel ranks without the user's help, and the
fingerprint that shows, after the first step, whether the ranks still hold the same weights.

flowrl's convention (``Model.all_reduce_grads``): each rank's loss is normalised by the
*global* batch size, so the gradients are **summed** over the ranks, never averaged. A step
pre-hook on each torch optimizer the trainer holds sums the gradients of its parameters
before it steps, except those ``all_reduce_grads`` already summed since that optimizer's last
step and those a wrapper reduces itself (DDP's, and sharded DTensor parameters).
"""

from __future__ import annotations

import hashlib
import types
from typing import TYPE_CHECKING, Any

from .._core.errors import ConfigError
from .._core.flow.model import sum_over_ranks

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from .._core.flow.model import Model

# parameters' elements, sum, sum of |w|, sum of w**2 (for people), blake2b of the bytes (compared)
Checksum = tuple[float, float, float, float, str]

# how far the search for optimizers, modules and scalers goes: self.state.opt, self.opts[0]...
_DEPTH = 3
_MAX_ITEMS = 256  # a longer list or dict (a vocabulary, a dataset) holds no optimizer worth the walk


def held(model: Model) -> list[tuple[str, Any]]:
    """What the model holds, with its path (``self.state.opt``): attributes, items of lists,
    tuples and dicts, and attributes of plain objects, ``_DEPTH`` levels deep, each object
    once. Torch modules, optimizers and tensors are leaves: their insides are torch's."""
    seen = {id(model)}
    out: list[tuple[str, Any]] = []
    level: list[tuple[str, Any]] = [("self", model)]
    for _ in range(_DEPTH):
        below: list[tuple[str, Any]] = []
        for path, obj in level:
            for sub, value in _children(path, obj):
                if id(value) in seen:
                    continue
                seen.add(id(value))
                out.append((sub, value))
                if _walkable(value):
                    below.append((sub, value))
        level = below
    return out


def _children(path: str, obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, (list, tuple)):
        return [(f"{path}[{i}]", v) for i, v in enumerate(obj)] if len(obj) <= _MAX_ITEMS else []
    if isinstance(obj, dict):
        return [(f"{path}[{k!r}]", v) for k, v in obj.items()] if len(obj) <= _MAX_ITEMS else []
    try:
        attributes = vars(obj)
    except TypeError:  # no __dict__ (slots, builtins)
        return []
    return [(f"{path}.{k}", v) for k, v in list(attributes.items())]


_OPAQUE = (type, types.ModuleType, types.FunctionType, types.MethodType, types.BuiltinFunctionType)


def _walkable(value: Any) -> bool:
    if isinstance(value, (list, tuple, dict)):
        return True
    if isinstance(value, _OPAQUE) or not hasattr(value, "__dict__"):
        return False
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(
        value, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, torch.amp.GradScaler)
    ):
        return False
    return True


def optimizers(model: Model) -> list[tuple[str, torch.optim.Optimizer]]:
    """The torch optimizers the model holds, with their paths."""
    import torch

    return [(path, v) for path, v in held(model) if isinstance(v, torch.optim.Optimizer)]


def _sharded(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed: nothing is sharded
        return False
    return isinstance(p, DTensor)


class GradReducer:
    """Sums gradients over the ranks before each step of the model's optimizers."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._hooked: set[int] = set()  # ids of the optimizers hooked
        self._handles: list[Any] = []  # the hooks' handles: the optimizers keep the hooks alive

    def attach(self) -> None:
        """Hook the optimizers the model holds now (called after setup and before each step,
        so one made later, in the first train_step, is hooked from the next step on)."""
        check_scaler(self.model)
        for _, value in optimizers(self.model):
            if id(value) not in self._hooked:
                self._hooked.add(id(value))
                self._handles.append(value.register_step_pre_hook(self._before_step))
                self._handles.append(value.register_step_post_hook(self._after_step))

    def _own(self) -> set[int]:
        """Parameters reduced by a wrapper the model holds (DDP): never summed again here."""
        import torch

        ddp = torch.nn.parallel.DistributedDataParallel
        found: set[int] = set()
        for _, value in held(self.model):
            if isinstance(value, torch.nn.Module):
                for sub in value.modules():
                    if isinstance(sub, ddp):
                        found.update(id(p) for p in sub.parameters())
        return found

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        done = self.model._reduced_grads | self._own()
        params = [
            p
            for group in optimizer.param_groups
            for p in group["params"]
            if p.requires_grad and id(p) not in done and not _sharded(p)
        ]
        sum_grads(params)
        self.model._reduced_grads.update(id(p) for p in params)
        self.model._grad_sums += 1

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # the next step of this optimizer sums its (new) gradients again
        self.model._reduced_grads.difference_update(id(p) for g in optimizer.param_groups for p in g["params"])


def unchecked(model: Model, reducer: GradReducer | None) -> list[str]:
    """After the first train step of a group of several ranks: what flowrl could not do for
    this trainer, said once (rank 0) rather than silently comparing or summing nothing."""
    import sys

    who = f"trainer {model.name!r} ({type(model).__name__}) on {model.world_size} ranks"
    said = []
    if reducer is not None and not model._reduced_grads and not optimizers(model) and "torch" in sys.modules:
        said.append(
            f"{who}: auto_reduce_grads is on but after the first train step the model holds no torch optimizer "
            f"(searched self's attributes, lists, dicts and plain objects, {_DEPTH} levels deep), so flowrl summed "
            "no gradients over the ranks. Hold the optimizer on the model (self.optimizer = ... in setup()), or "
            "call self.all_reduce_grads(module) before updating the weights"
        )
    if "torch" in sys.modules and not trainable(model)[1]:
        said.append(
            f"{who}: found no trainable parameters (self.module, modules and optimizers the model holds, "
            f"{_DEPTH} levels deep), so the ranks' weights are not compared after the first step. Set "
            "self.module to the module being trained"
        )
    return said


def sum_grads(params: list[torch.Tensor]) -> None:
    """Sum the gradients of ``params`` over the ranks (every rank passes the same list). A
    parameter without a gradient on some rank gets zeros there; one without a gradient on
    every rank keeps none, so an optimizer skips it as it would with one rank."""
    if not params:
        return
    import torch
    import torch.distributed as dist

    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
    dist.all_reduce(present)
    todo = [p for p, n in zip(params, present.tolist(), strict=True) if n]
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for p in todo:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_kind.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in by_kind.values():  # one flat collective per dtype and device
        sum_over_ranks(grads)


def trainable(model: Model) -> tuple[list[torch.Tensor], bool]:
    """The trainable parameters of ``self.module``, of the modules and of the optimizers the
    model holds (``held``), each once, sharded ones left out (their shards differ by design);
    and whether any trainable parameter was found at all, sharded ones included."""
    import torch

    found: dict[int, torch.Tensor] = {}
    sources: list[Iterable[torch.Tensor]] = []
    for _, value in held(model):
        if isinstance(value, torch.nn.Module):
            sources.append(value.parameters())
        elif isinstance(value, torch.optim.Optimizer):
            sources.extend(g["params"] for g in value.param_groups)
    anything = False
    for params in sources:
        for p in params:
            if isinstance(p, torch.Tensor) and p.requires_grad:
                anything = True
                if not _sharded(p):
                    found.setdefault(id(p), p)
    return list(found.values()), anything


def has_shards(model: Model) -> bool:
    """Whether a module the model holds has a sharded parameter (each rank holds its own part)."""
    import torch

    return any(
        isinstance(value, torch.nn.Module) and any(_sharded(p) for p in value.parameters()) for _, value in held(model)
    )


def checksum(model: Model) -> Checksum | None:
    """A fingerprint of this rank's trainable weights: float64 sums to show, and a hash of
    their bytes in a fixed order to compare (ranks that summed the same gradients hold the
    same bits; a tolerance would miss an Adam step at lr 1e-6). None when the model has none
    to compare (no torch, no parameters, only sharded ones)."""
    import sys

    if "torch" not in sys.modules:  # a model that never imported torch holds no parameters
        return None
    params, _ = trainable(model)
    if not params:
        return None
    import torch

    count = total = absolute = squares = 0.0
    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for p in params:
            w = p.detach()
            count += w.numel()
            total += float(w.sum(dtype=torch.float64))
            absolute += float(torch.linalg.vector_norm(w, ord=1, dtype=torch.float64))
            squares += float(torch.linalg.vector_norm(w, ord=2, dtype=torch.float64)) ** 2
            digest.update(str((tuple(w.shape), w.dtype)).encode())
            digest.update(w.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return (count, total, absolute, squares, digest.hexdigest())


def check_scaler(model: Model) -> None:
    """A ``GradScaler`` skips ``optimizer.step()`` on a rank whose gradients hold inf or NaN:
    that rank would never join the gradient sum in the step pre-hook and the others would wait
    for it forever. Refused before episode 0 while flowrl would sum through the hook."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return
    scalers = [path for path, v in held(model) if isinstance(v, torch.amp.GradScaler)]
    held_optimizers = optimizers(model)
    params = [p for _, o in held_optimizers for g in o.param_groups for p in g["params"]]
    if not scalers or (params and all(_sharded(p) for p in params)):
        return  # sharded parameters (FSDP and its ShardedGradScaler) are not summed by the hook
    found = ", ".join(path for path, _ in held_optimizers)
    raise ConfigError(
        f"trainer {model.name!r} ({type(model).__name__}) runs on {model.world_size} ranks with "
        f"auto_reduce_grads = True and holds a GradScaler ({', '.join(scalers)}), "
        f"{f'optimizers {found}' if found else 'no optimizer yet'}: scaler.step() skips optimizer.step() on a "
        "rank that found inf, so that rank never joins the gradient sum flowrl makes before each step and the "
        "others wait forever. Set auto_reduce_grads = False in the class and call "
        "self.all_reduce_grads(module) after scaler.scale(loss).backward() and before "
        "scaler.unscale_()/scaler.step() (every rank then sees the same gradients and skips alike)"
    )
