"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the HF trainers: parameters, gradients
and optimizer state split over the data-parallel ranks, on GPUs (NCCL) and CPUs (gloo) alike.

Gradients are summed over the ranks, not averaged: the trainers' losses are normalised by
counts of the whole global batch, so the sum is the global batch's gradient.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def shard(module: torch.nn.Module) -> None:
    """Shard each transformer block (the classes ``transformers`` lists as not to be split),
    then the rest (embeddings, final norm, head) as one group."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    body = getattr(module, "body", module)
    blocks = set(getattr(body, "_no_split_modules", None) or [])
    for sub in module.modules():
        if type(sub).__name__ in blocks:
            fully_shard(sub)
    fully_shard(module)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            if hasattr(sub, "set_force_sum_reduction_for_comms"):  # torch >= 2.12
                sub.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no pre-multiplied sum


def _options(cpu: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu)


def full_weights(module: torch.nn.Module, cpu: bool) -> dict[str, Any]:
    """Every parameter whole (collective: all ranks call it). With ``cpu``, rank 0 gets them
    in host memory and the other ranks an empty dict; without, every rank gets a whole copy on
    its GPU for the moment of the sync (the cost of sending CUDA tensors from a sharded model)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(cpu))


class Gathered(Mapping[str, Any]):
    """A sharded module's weights, each gathered whole only when it is read, so that sending
    them to a GPU replica holds one whole tensor at a time besides the sent copy, not a second
    copy of the model. Reading is collective: every rank reads every value, in this order
    (``flowrl``'s replica side reads them all on the ranks that send nothing).
    ``specs`` and ``device_type`` say what the values will be without gathering them."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._shards = module.state_dict()  # the ranks' DTensors: no copy, nothing gathered

    def __getitem__(self, key: str) -> Any:
        value = self._shards[key].detach()
        full = getattr(value, "full_tensor", None)
        return full() if full is not None else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._shards)

    def __len__(self) -> int:
        return len(self._shards)

    def specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """Each value's name, dtype and whole shape (a DTensor reports its global shape)."""
        return [(k, v.dtype, tuple(v.shape)) for k, v in self._shards.items()]

    @property
    def device_type(self) -> str:
        return next(iter(self._shards.values())).device.type if self._shards else "cpu"


def full_optimizer_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, whole, on the host (collective for a
    sharded module). Sharded or not, the same format: a checkpoint resumes on any rank count."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not optimizer.state:  # no step yet: reading would initialise the state with a step of lr 0
        return {}
    state: dict[str, Any] = get_optimizer_state_dict(module, optimizer, options=_options(True))
    return state


def load_full(module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load whole weights and optimizer state given to every rank; a sharded module's rank
    keeps its shard."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    options = _options(False)
    set_model_state_dict(module, dict(state["module"]), options=options)
    if state.get("optimizer"):
        set_optimizer_state_dict(module, optimizer, dict(state["optimizer"]), options=options)


def norm(value: Any) -> float:
    """A gradient norm as a float (a sharded model's is a DTensor)."""
    full = getattr(value, "full_tensor", None)
    return float(full() if full is not None else value)
