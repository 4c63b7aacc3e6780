"""Gradients summed over a trainer's data-parallel ranks without the user's help, and the
checksum that shows, after the first step, whether the ranks still hold the same weights.

flowrl's convention (``Model.all_reduce_grads``): each rank's loss is normalised by the
*global* batch size, so the gradients are **summed** over the ranks, never averaged. A step
pre-hook on each torch optimizer the trainer holds sums the gradients of its parameters
before it steps, except those ``all_reduce_grads`` already summed since that optimizer's last
step and those a wrapper reduces itself (DDP's, and sharded DTensor parameters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._core.model import sum_over_ranks

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from .._core.model import Model

Checksum = tuple[float, float, float, float]  # parameters' elements, sum, sum of |w|, sum of w**2


def _held(model: Model) -> list[Any]:
    """The values the model holds as attributes, and the items of its lists, tuples and dicts."""
    out: list[Any] = []
    for value in vars(model).values():
        if isinstance(value, (list, tuple)):
            out.extend(value)
        elif isinstance(value, dict):
            out.extend(value.values())
        else:
            out.append(value)
    return out


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
        import torch

        for value in _held(self.model):
            if isinstance(value, torch.optim.Optimizer) and id(value) not in self._hooked:
                self._hooked.add(id(value))
                self._handles.append(value.register_step_pre_hook(self._before_step))
                self._handles.append(value.register_step_post_hook(self._after_step))

    def _own(self) -> set[int]:
        """Parameters reduced by a wrapper the model holds (DDP): never summed again here."""
        import torch

        ddp = torch.nn.parallel.DistributedDataParallel
        found: set[int] = set()
        for value in _held(self.model):
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

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # the next step of this optimizer sums its (new) gradients again
        self.model._reduced_grads.difference_update(id(p) for g in optimizer.param_groups for p in g["params"])


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


def trainable(model: Model) -> list[torch.Tensor]:
    """The trainable parameters of ``self.module`` and of the optimizers the model holds, each
    once, sharded ones left out (their shards differ by design)."""
    import torch

    found: dict[int, torch.Tensor] = {}
    sources: list[Iterable[torch.Tensor]] = []
    module = getattr(model, "module", None)
    if isinstance(module, torch.nn.Module):
        sources.append(module.parameters())
    for value in _held(model):
        if isinstance(value, torch.optim.Optimizer):
            sources.extend(g["params"] for g in value.param_groups)
    for params in sources:
        for p in params:
            if isinstance(p, torch.Tensor) and p.requires_grad and not _sharded(p):
                found.setdefault(id(p), p)
    return list(found.values())


def checksum(model: Model) -> Checksum | None:
    """A cheap fingerprint of this rank's trainable weights (float64 sums), or None when the
    model has none to compare (no torch, no module, only sharded parameters)."""
    import sys

    if "torch" not in sys.modules:  # a model that never imported torch holds no parameters
        return None
    params = trainable(model)
    if not params:
        return None
    import torch

    count = total = absolute = squares = 0.0
    with torch.no_grad():
        for p in params:
            w = p.detach()
            count += w.numel()
            total += float(w.sum(dtype=torch.float64))
            absolute += float(torch.linalg.vector_norm(w, ord=1, dtype=torch.float64))
            squares += float(torch.linalg.vector_norm(w, ord=2, dtype=torch.float64)) ** 2
    return (count, total, absolute, squares)
