"""Run by test_multinode.py in a fresh process: a node with half the replicas is removed in
the middle of a run; the run completes on the other node."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
from ray.cluster_utils import Cluster

import flowrl
from flowrl.testing import Scale, flowrl_actor_names


async def run(cluster: Cluster, worker) -> dict:
    gen = Scale("gen", {"num_replicas": 4, "gpus_per_replica": 1, "cpus_per_replica": 0.5, "batch_size": 2},
                srcs=["x"], dst="y", factor=3, sleep_s=0.05)
    config = flowrl.PipelineConfig(ray_address=cluster.address)
    out = []
    async with flowrl.open_pipeline(lambda x: gen.forward_step(x), config) as pipe:
        placement = pipe.placement["gen"]
        async for sample in pipe.stream([{"x": np.full(2, float(i))} for i in range(48)]):
            out.append(sample)
            if len(out) == 8:  # the worker node's replicas hold shards now
                await asyncio.to_thread(cluster.remove_node, worker)
        stats = pipe.stats()["gen.forward_step"]
    return {
        "placement": placement,
        "ok": [s.id for s in out] == list(range(48)) and all(np.allclose(s["y"], 3 * s.id) for s in out),
        "samples": stats.samples,
        "retried": stats.retried,
        "worked_after": sorted({s["gen_replica"] for s in out[32:]}),
    }


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=2, num_gpus=2)
    cluster.wait_for_nodes()
    try:
        result = asyncio.run(run(cluster, worker))
        import ray

        ray.init(address=cluster.address)
        result["left_after"] = flowrl_actor_names()
        result["head"] = ray.get_runtime_context().get_node_id()
        ray.shutdown()
        print(json.dumps(result))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
