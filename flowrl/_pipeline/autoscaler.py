"""The autoscaler: a control loop that reads each autoscaled pool's queue and starvation and
resizes it within its limits (the policy itself is pure: ``_core/scheduling/autoscale.py``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import anyio

from .._core.errors import FlowError
from .._core.scheduling.autoscale import AutoscalePolicy, Reading

if TYPE_CHECKING:
    from .._backends.abc import Cluster
    from .._core.settings.config import Autoscale
    from .parts import Parts
    from .resizer import Resizer
    from .runs import Runs

log = logging.getLogger("flowrl")
Sample = tuple[float, float]  # (when, starved seconds so far)


class Autoscaler:
    def __init__(self, parts: Parts, resizer: Resizer, runs: Runs) -> None:
        self._graph = parts.graph
        self._cluster: Cluster = parts.backend
        self._pools = parts.pools
        self._roster = parts.roster
        self._resizer = resizer
        self._runs = runs
        self._recorder = parts.recorder
        self.configs: dict[str, Autoscale] = {
            n: m.config.autoscale for n, m in parts.graph.models.items() if m.config.autoscale is not None
        }

    async def run(self) -> None:
        """Resize the autoscaled pools every ``Autoscale.every_s`` (the shortest of them) while runs go on."""
        policy = AutoscalePolicy(self.configs)
        every = min(c.every_s for c in self.configs.values())
        last = self._starvation()
        while True:
            await anyio.sleep(every)  # a control loop's period
            now = self._starvation()
            if not self._runs.running():
                policy.reset()
            else:
                readings = [self._reading(n, last[n], now[n]) for n in self.configs]
                for event in policy.decide(readings, await self._cluster.free()):
                    try:
                        await self._resizer.resize(event.model, event.after, reason=event.reason, reading=event.reading)
                    except FlowError as err:  # e.g. no room after all: the run goes on as it is
                        log.warning(
                            "autoscaler: could not %s %s to %d replicas: %s",
                            event.action,
                            event.model,
                            event.after,
                            err,
                        )
            last = now

    def _starvation(self) -> dict[str, Sample]:
        """Per model: (now, starved seconds so far, open intervals included)."""
        now = time.perf_counter()
        out = {}
        for name in self.configs:
            retired = self._pools[name].scheduler.retired  # a dead replica is not starved
            out[name] = (now, self._recorder.starved_s(name) + self._roster.open_starvation(name, now, retired))
        return out

    def _reading(self, model: str, before: Sample, after: Sample) -> Reading:
        serving = len(self._resizer.serving(model))
        elapsed = max(1e-9, after[0] - before[0]) * serving
        queued = sum(q for q, _ in self._pools[model].scheduler.queues().values())
        spec = self._resizer.joining.spec(self._graph.models[model], 0, None)
        return Reading(
            model=model,
            serving=serving,
            queued=queued,
            starved=min(1.0, (after[1] - before[1]) / elapsed),
            batch_size=self._graph.models[model].config.batch_size,
            cpus=spec.num_cpus,
            gpus=spec.num_gpus,
        )
