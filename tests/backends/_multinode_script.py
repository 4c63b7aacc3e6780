"""Run by test_multinode.py in a fresh process: two simulated nodes, flowrl joins by address."""

from __future__ import annotations

import json
import sys

import numpy as np
from ray.cluster_utils import Cluster

import flowrl
from flowrl.testing import Scale, flowrl_actor_names


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2, num_gpus=2)
    cluster.wait_for_nodes()
    try:
        # 4 replicas of 1 GPU each cannot fit on one 2-GPU node: Ray must use both nodes
        gen = Scale(
            "gen",
            {"num_replicas": 4, "gpus_per_replica": 1, "cpus_per_replica": 0.5, "batch_size": 2},
            srcs=["x"],
            dst="y",
            factor=3,
            sleep_s=0.01,
        )
        config = flowrl.PipelineConfig(ray_address=cluster.address)
        with flowrl.Pipeline(lambda x: gen.forward_step(x), config) as pipe:
            out = pipe.run([{"x": np.full(2, float(i))} for i in range(20)])
            placement = pipe.placement["gen"]
            stats = pipe.stats()
            import ray

            nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
            live_during = flowrl_actor_names()
        assert not ray.is_initialized()  # flowrl connected, so flowrl disconnected
        # 3 GPUs fit the cluster's 4 in total but no 2-GPU node: an error at once, not a wait
        wide = Scale("wide", {"num_replicas": 1, "gpus_per_replica": 3, "cpus_per_replica": 0.5}, srcs=["x"])
        try:
            with flowrl.Pipeline(lambda x: wide.forward_step(x), config):
                node_fit = "started"
        except flowrl.ClusterError as err:
            node_fit = str(err)
        ray.init(address=cluster.address)
        left_after = flowrl_actor_names()
        ray.shutdown()
        print(
            json.dumps(
                {
                    "placement": placement,
                    "nodes": nodes,
                    "ok": all(np.allclose(s["y"], 3 * s.id) for s in out) and [s.id for s in out] == list(range(20)),
                    "samples": stats["gen.forward_step"].samples,
                    "live_during": len(live_during),
                    "left_after": left_after,
                    "node_fit": node_fit,
                }
            )
        )
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
