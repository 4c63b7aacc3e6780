"""Run by test_chaos.py in a fresh process, on a cluster of its own (``ray.cluster_utils``): the
chaos run with kills, and a worker node lost as well, against the calm run.

The driver's node has 2 logical GPUs and the worker node 2; each policy and scorer replica asks
for one, so one pool's placement group sits on each node. Once the engine has started, a spare
node of the same size joins (nodes are added from the main thread only), and a thread removes the
worker node once the checkpoint of an episode drawn from the seed is written. The calm run asks
for no GPU and runs on the driver's node alone: the layouts differ, the results may not.

    python tests/engine/_chaos_node_script.py TMP   # prints the summary as JSON, its last line
"""

from __future__ import annotations

import json
import random
import sys
import threading
from pathlib import Path
from typing import Any

import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
from _chaos_models import run, summary  # noqa: E402

from flowrl.testing import flowrl_actor_names  # noqa: E402

EPISODES, SEED = 10, 11
DEATHS = {"policy": 10, "scorer": 10, "trainer": 3}


class NodeLoss:
    """Removes ``node`` once ``checkpoint`` exists; records which replicas it held."""

    def __init__(self, cluster: Cluster, node: Any, checkpoint: Path) -> None:
        self.cluster, self.node, self.checkpoint = cluster, node, checkpoint
        self.held: dict[str, list[int]] = {}
        self.ended = threading.Event()

    def __call__(self, engine: Any) -> Any:
        self.cluster.add_node(num_cpus=2, num_gpus=2)  # the spare
        self.cluster.wait_for_nodes()
        thread = threading.Thread(target=self._remove, args=(engine._session.deployment,), daemon=True)
        thread.start()

        def stop() -> None:
            self.ended.set()
            thread.join()

        return stop

    def _remove(self, deployment: Any) -> None:
        # a checkpoint's folder appears once it is written whole (renamed into place)
        while not self.checkpoint.exists():
            if self.ended.wait(0.05):
                return
        rollout, here = deployment.rollout, self.node.node_id
        placement = rollout.placement  # every replica started, the dead ones too: those serving count
        self.held = {m: [r for r in rollout.serving(m) if ids[r] == here] for m, ids in placement.items()}
        self.held["trainer"] = [h.replica_id for h in deployment.trainers["trainer"] if h.node_id == here]
        self.cluster.remove_node(self.node)


def main() -> None:
    tmp = Path(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "num_gpus": 2, "include_dashboard": False})
    try:
        ray.init(address=cluster.address)
        calm = run(tmp / "calm", EPISODES, {}, SEED)
        worker = cluster.add_node(num_cpus=2, num_gpus=2)
        cluster.wait_for_nodes()
        episode = random.Random(SEED).randint(2, EPISODES - 3)
        loss = NodeLoss(cluster, worker, tmp / "chaos" / "checkpoints" / f"episode-{episode:06d}")
        chaotic = run(tmp / "chaos", EPISODES, DEATHS, SEED, gpus=True, during=loss)
        result = summary(calm, chaotic, EPISODES) | {"held": loss.held, "node_lost_after_episode": episode}
        result["left_after"] = flowrl_actor_names()
        ray.shutdown()
        print(json.dumps(result))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
