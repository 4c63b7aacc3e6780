"""Run by test_multinode.py in a fresh process: a node holding half of a stage's replicas is
removed in the middle of a run, in three scenarios, each on a new worker node of one cluster:

- "small outputs": shards running there go back to the queue; the run completes on the head.
- "two stages": outputs over 64 KiB a shard (kept in that node's object store) waiting for the
  next stage are lost with the node; they are computed again on the head node.
- "one stage": such outputs of finished samples waiting to be delivered are lost; likewise.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import numpy as np
from ray.cluster_utils import Cluster

import flowrl
from flowrl.testing import Scale, flowrl_actor_names

BIG = 20_000  # float64s per sample: a shard of 2 returns 320 KB, kept in its node's object store


class SlowOnHead(Scale):
    """Slower on the head node: the worker's replicas take most samples, and their outputs wait."""

    def forward_step(self, batch: Any, iteration: int) -> dict[str, Any]:
        if self.node_id == self.head:
            time.sleep(self.head_delay)
        return super().forward_step(batch, iteration)


async def run(cluster: Cluster, worker, head: str, *, width: int, two_stages: bool, head_delay: float) -> dict:
    # the worker node has 1 CPU: two gen replicas fill it, so the scorer sits on the head node
    gen = SlowOnHead(
        "gen",
        {"num_replicas": 4, "gpus_per_replica": 1, "cpus_per_replica": 0.5, "batch_size": 2},
        srcs=["x"],
        dst="y",
        factor=3,
        sleep_s=0.01 if width == BIG else 0.05,
    )
    gen.head, gen.head_delay = head, head_delay
    score = Scale(
        "score",
        {"num_replicas": 1, "cpus_per_replica": 1, "batch_size": 2},
        srcs=["y"],
        dst="z",
        factor=2,
        sleep_s=0.05,
    )

    def flow(x):
        y = gen.forward_step(x)
        return score.forward_step(y) if two_stages else y

    out = []
    async with flowrl.open_pipeline(flow, flowrl.PipelineConfig(ray_address=cluster.address)) as pipe:
        placement = pipe.placement
        async for sample in pipe.stream([{"x": np.full(width, float(i))} for i in range(48)]):
            out.append(sample)
            if len(out) == (4 if width == BIG else 8):  # the worker's replicas hold shards, or outputs
                # that wait for the scorer or to be delivered (none is while the node goes)
                await asyncio.to_thread(cluster.remove_node, worker)
        stats = pipe.stats()
    stages = ("gen", "score")[: 1 + two_stages]
    return {
        "placement": placement,
        "ok": [s.id for s in out] == list(range(48))
        and all(np.array_equal(s["y"], np.full(width, 3.0 * s.id)) for s in out)
        and all(np.array_equal(s["z"], np.full(width, 6.0 * s.id)) for s in out if two_stages),
        "samples": {k: stats[f"{k}.forward_step"].samples for k in stages},
        "retried": {k: stats[f"{k}.forward_step"].retried for k in stages},
        "worked_after": sorted({s["gen_replica"] for s in out[32:]}),
    }


SCENARIOS = {
    "small outputs": {"width": 2, "two_stages": False, "head_delay": 0.0},
    "two stages": {"width": BIG, "two_stages": True, "head_delay": 0.1},
    "one stage": {"width": BIG, "two_stages": False, "head_delay": 0.1},
}


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2, "include_dashboard": False})
    try:
        import ray

        ray.init(address=cluster.address)
        result: dict[str, Any] = {"head": ray.get_runtime_context().get_node_id()}
        for name, scenario in SCENARIOS.items():
            worker = cluster.add_node(num_cpus=1, num_gpus=2)
            cluster.wait_for_nodes()
            result[name] = asyncio.run(run(cluster, worker, result["head"], **scenario))
        result["left_after"] = flowrl_actor_names()
        ray.shutdown()
        print(json.dumps(result))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
