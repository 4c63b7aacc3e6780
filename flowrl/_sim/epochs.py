"""Several epochs of a workload on the simulator, the scheduler fed by a length memory (sans-IO).

Each epoch runs the same prompts again (``Workload.epoch``); before it, the ``LengthMemory``
the engine keeps (``RunConfig.length_field``) predicts each sample from the lengths its prompt
had in the epochs before, and the scheduler gets those predictions as costs, as the engine
hands them to its rollout. A sample's length is its first stage's tail (the generation).
"""

from __future__ import annotations

import msgspec

from .._core.scheduling.lengths import LengthMemory
from .simulate import SimResult, Workload, simulate, tails


def prompt_keys(workload: Workload) -> list[int]:
    """Each sample's prompt: a group's ``group`` consecutive samples share one (``tails``)."""
    return [i // workload.group for i in range(workload.samples)]


def simulate_epochs(workload: Workload, epochs: int, *, remember: bool = True) -> list[SimResult]:
    """One result per epoch; ``remember=False`` schedules every epoch without predictions."""
    memory = LengthMemory()
    prompts = prompt_keys(workload)
    first = workload.stages[0].name
    out = []
    for epoch in range(epochs):
        w = msgspec.structs.replace(workload, epoch=epoch)
        costs = memory.costs(prompts) if remember and len(memory) else None
        out.append(simulate(w, costs))
        memory.observe(prompts, tails(w)[first].tolist())
    return out
