"""Chaos from outside: an engine in deterministic mode on a local Ray cluster while a thread of
the driver kills its policy, scorer and trainer actors (``ray.kill``) at random times drawn
from a seed, against the same run without kills. Writes
``benchmarks/results/<date>-cpu<N>-chaos.json`` and prints the table of docs/reliability.md.

    python benchmarks/run.py chaos [--episodes 100] [--kills 25] [--gap-s 0.5] [--seed 0] [--node-loss] [--ranks 1]

The kills land wherever the run is: in a shard, between shards, in a weight sync, in a
checkpoint. With ``--node-loss`` the runs are on a
``ray.cluster_utils.Cluster``, the policy and scorer replicas asking for one logical GPU each:
the calm run on the driver's node alone (asking for none), the run with kills on it and a worker
node, where one pool's replicas land (``NodeLoss``). The worker node is removed once, after a
number of kills drawn from the seed, as soon as it holds a live replica: its replicas, and the
outputs its object store held, are lost with it.

What is checked: the trained weights and every per-episode loss bit for bit equal to the calm
run's, every sample trained once (the trainer's counts), the pools back at their size, each of
the lost node's replicas replaced. What is measured: each kill's recovery (a replica: from the
death noticed to its replacement serving; a trainer: to its ranks restored from a surviving
rank (``--ranks 2``, a rank killed while its peer can go on) or from the last checkpoint; the
node's replicas: from its removal to each replacement serving).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import flowrl

if TYPE_CHECKING:
    from collections.abc import Callable

PER_EPISODE, MODELS = 8, ("policy", "scorer", "trainer")
CPU = {"cpus_per_replica": 0.1}
# kills come far faster than in life and hit replacements still starting: more of them in a row
# than Healing's default 3 before a replica is left out, and more a minute than its default 10
HEALING = {"healing": {"max_restarts": 10, "per_minute": 30, "backoff_s": 0.5}}
STEP_S = 0.05  # each call sleeps this long, so that an episode lasts long enough to be hit


class Policy(flowrl.Model):
    """``y = w.x`` plus noise from each sample's own stream (the same draw on any replica)."""

    def setup(self) -> None:
        self.w = np.full(4, 0.5)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(STEP_S)
        noise = [rng.normal() for rng in batch.rngs()]
        return {"y": [float(self.w @ np.asarray(x)) + 0.1 * n for x, n in zip(batch["x"], noise, strict=True)]}

    def set_weights(self, weights: Any) -> None:
        self.w = np.asarray(weights["w"])

    def get_weights(self) -> dict[str, Any]:  # its starting weights, kept for a rebuild before the first sync
        return {"w": self.w.copy()}


class Scorer(flowrl.Model):
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        time.sleep(STEP_S)
        return {"score": [1.0 - min((float(y) - 1.0) ** 2, 4.0) for y in batch["y"]]}


class Trainer(flowrl.Model):
    """Least squares of ``w.x`` on the scores, one SGD step a batch (the gradients summed over
    the ranks by flowrl); reports ``w`` exactly."""

    def setup(self) -> None:
        import torch

        self.module = torch.nn.Linear(4, 1, bias=False, dtype=torch.float64)
        torch.nn.init.constant_(self.module.weight, 0.5)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.01)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        import torch

        time.sleep(STEP_S)
        x, target = torch.as_tensor(np.asarray(batch["x"])), torch.as_tensor(np.asarray(batch["score"]))
        loss = ((self.module(x).squeeze(1) - target) ** 2).sum() / self.global_batch_size
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss), "w": self.weights().tolist()}

    def weights(self) -> np.ndarray:
        return self.module.weight.detach().numpy().ravel().copy()

    def get_weights(self) -> dict[str, Any]:
        return {"w": self.weights()}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def restore_state(self, state: Any) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])


ACTOR = re.compile(r"flowrl-[0-9a-f]+-(policy|scorer|trainer)-(\d+)(-\d+)?")  # a rebuilt rank: -<generation>


def model_of(actor: str) -> str:
    """``flowrl-<run>-<model>-<replica>[-<generation>]`` -> ``<model>`` (one of ``MODELS``, else "")."""
    found = ACTOR.fullmatch(actor)
    return found.group(1) if found else ""


class Killer(threading.Thread):
    """Kills ``kills`` actors of ``MODELS``, one every ``gap_s`` seconds on average (exponential
    gaps), each of a kind chosen at random among those alive, from ``seed`` (a replacement
    or a rebuilt rank still starting may be hit too). With ``node_loss``, the node is removed
    once, after a number of kills drawn from the seed (a quarter to three quarters), at the first
    tick from then on where it holds a replica that serves and was not killed."""

    def __init__(self, seed: int, kills: int, gap_s: float, node_loss: bool = False) -> None:
        super().__init__(daemon=True)
        self.rng, self.kills, self.gap_s = random.Random(seed), kills, gap_s
        self.stop, self.done = threading.Event(), []  # (seconds into the run, actor)
        self.node_after = self.rng.randint(kills // 4, 3 * kills // 4) if node_loss else None
        self.remove_node: Callable[[], bool] | None = None  # set by run(), which knows the node

    def run(self) -> None:
        import ray

        from flowrl.testing import flowrl_actor_names

        start = time.monotonic()
        while (len(self.done) < self.kills or self.node_after is not None) and not self.stop.wait(
            self.rng.expovariate(1 / self.gap_s)
        ):
            if self.node_after is not None and len(self.done) >= self.node_after and self.remove_node is not None:
                if self.remove_node():  # else the node holds no live replica now: at a later tick
                    self.node_after = None
                continue
            alive = [a for a in flowrl_actor_names() if model_of(a)]
            if not alive:
                continue
            kind = self.rng.choice(sorted({model_of(a) for a in alive}))  # each kind alike, whatever its size
            victim = self.rng.choice([a for a in alive if model_of(a) == kind])
            try:
                ray.kill(ray.get_actor(victim, namespace="flowrl"), no_restart=True)
            except ValueError:  # gone meanwhile (stopped, or replaced)
                continue
            self.done.append((round(time.monotonic() - start, 2), victim))


class NodeLoss:
    """The worker node of ``cluster`` and, once removed, which replicas it held and when.

    Each pool's replicas ask for a GPU a replica, and the driver's node has 2: one pool's
    placement group fits there, the other's goes to the worker node. Once they are placed, a
    spare node of the same size joins (``spare``, as a standby node would): when the worker goes,
    the lost replicas' replacements have room, and their recovery is flowrl's, not a node's boot.
    (Ray adds nodes from the main thread only; the killer's thread removes one.)"""

    def __init__(self, cluster: Any) -> None:
        self.cluster, self.node = cluster, cluster.add_node(num_cpus=2, num_gpus=2)
        cluster.wait_for_nodes()
        self.held: dict[str, list[int]] = {}  # model -> replicas on the node when it went
        self.at = 0.0  # wall clock of the removal

    def remove(self, rollout: Any, killed: list[tuple[float, str]]) -> bool:
        """Removes the node if it holds a replica that serves and was not killed (a death the pool
        has not noticed yet: an idle replica's is noticed at its next call); ``held``: those."""
        dead = {(f[1], int(f[2])) for _, a in killed if (f := ACTOR.fullmatch(a))}
        placement = rollout.placement  # every replica started, the dead ones too
        held = {
            m: [r for r in rollout.serving(m) if ids[r] == self.node.node_id and (m, r) not in dead]
            for m, ids in placement.items()
        }
        if not any(held.values()):
            return False
        self.held = held
        self.at = time.time()
        self.cluster.remove_node(self.node)
        return True

    def spare(self) -> None:
        self.cluster.add_node(num_cpus=2, num_gpus=2)
        self.cluster.wait_for_nodes()

    def lost(self, event: Any) -> bool:
        """Whether ``event`` (a ``ScaleEvent``) replaced a replica that went with the node."""
        found = re.match(r"replaced replica (\d+),", event.reason)
        return found is not None and int(found[1]) in self.held.get(event.model, [])


def run(
    folder: Path,
    episodes: int,
    seed: int,
    killer: Killer | None,
    node: NodeLoss | None = None,
    gpus: bool = False,
    ranks: int = 1,
) -> dict[str, Any]:
    gpu = {"gpus_per_replica": 1} if gpus else {}  # logical GPUs, to spread the replicas over the nodes
    policy = Policy("policy", {"num_replicas": 2, "batch_size": 2, **CPU, **gpu, **HEALING})
    scorer = Scorer("scorer", {"num_replicas": 2, "batch_size": 1, **CPU, **gpu, **HEALING})
    trainer = Trainer("trainer", {"num_replicas": ranks, **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: scorer.forward_step(policy.forward_step(x)),
        train=[trainer],
        sync=[(trainer, policy)],
        config={
            "sample_per_episode": PER_EPISODE,
            "num_episode": episodes,
            "seed": seed,
            "progress": "off",
            "reproducibility": {"deterministic": True},
            "checkpoint": {"dir": str(folder / "checkpoints"), "every": 1, "max_trainer_restarts": 100},
            "pipeline": {"max_retries": 20},
        },
    )
    engine.set_dataset([{"x": np.linspace(-1, 1, 4) * (i % 5)} for i in range(40)])
    started = time.monotonic()
    with engine:
        if killer is not None:
            if node is not None:
                node.spare()
                rollout = engine._session.deployment.rollout  # noqa: SLF001 - where the replicas are
                killer.remove_node = lambda: node.remove(rollout, killer.done)
            killer.start()
        try:
            engine.learn()
        finally:
            if killer is not None:
                killer.stop.set()
                killer.join()
        rollout = engine._session.deployment.rollout  # noqa: SLF001 - the driver reads the pools' size
        engine._portal.call(rollout.healed)  # noqa: SLF001
        serving = {m: len(rollout.serving(m)) for m in ("policy", "scorer")}
        stats = engine.stats()
    return {
        "seconds": time.monotonic() - started,
        "results": [list(e["trainer"]) for e in engine.train_results],
        "trained": stats.trainers["trainer"].samples,
        "serving": serving,
        "replaced": {  # the replacements of killed replicas; those of the node's are apart
            m: [e.recovery_s for e in stats.replaced if e.model == m and not (node and node.lost(e))]
            for m in ("policy", "scorer")
        },
        "rebuilds": [r.seconds for r in stats.rebuilds],
        "rebuilt_from": [r.source for r in stats.rebuilds],
        "redone": sum(r.redone for r in stats.rebuilds),
        "kills": killer.done if killer is not None else [],
        "node": None  # from the node's removal to each of its replicas' replacements serving
        if node is None or killer is None
        else {"held": node.held, "recovery_s": [e.time - node.at for e in stats.replaced if node.lost(e)]},
    }


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} / {max(values):.2f}" if values else "-"


def table(calm: dict[str, Any], chaos: dict[str, Any], episodes: int) -> str:
    same = chaos["results"] == calm["results"]
    expected = episodes * PER_EPISODE
    by_kind = {m: sum(model_of(a) == m for _, a in chaos["kills"]) for m in MODELS}
    times = {**chaos["replaced"], "trainer": chaos["rebuilds"]}
    head = "| kind | kills | recoveries | recovery s (median / max) | samples lost | trained twice | weights as calm |"
    lost, twice = max(expected - chaos["trained"], 0), max(chaos["trained"] - expected, 0)
    kills, recoveries = dict(by_kind), {m: str(len(times[m])) for m in MODELS}
    node = chaos["node"]
    if node is not None:  # the node's replicas, each replaced: recovery from the removal
        times["node"], kills["node"] = node["recovery_s"], 1
        recoveries["node"] = f"{len(times['node'])} of {sum(map(len, node['held'].values()))}"
    rows = [
        f"| {m} | {k} | {recoveries[m]} | {spread(times[m])} | {lost} | {twice} | {'yes' if same else 'NO'} |"
        for m, k in kills.items()
    ]
    return "\n".join([head, "| --- " * 7 + "|", *rows])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--kills", type=int, default=25)
    parser.add_argument("--gap-s", type=float, default=0.5, help="mean seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--node-loss", action="store_true", help="two nodes; the worker removed once, with kills")
    parser.add_argument("--ranks", type=int, default=1, help="the trainer's data-parallel ranks")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import tempfile

    import ray
    from ray.cluster_utils import Cluster

    cluster = None
    if args.node_loss:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "num_gpus": 2})
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:  # the calm run asks for no GPU: with --node-loss, another layout
            calm = run(Path(tmp, "calm"), args.episodes, args.seed, None, ranks=args.ranks)
            node = NodeLoss(cluster) if cluster is not None else None
            killer = Killer(args.seed, args.kills, args.gap_s, node_loss=node is not None)
            chaos = run(Path(tmp, "chaos"), args.episodes, args.seed, killer, node, args.node_loss, args.ranks)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    held = chaos["node"]["held"] if chaos["node"] is not None else {}
    ok = (
        chaos["results"] == calm["results"]
        and chaos["trained"] == calm["trained"] == args.episodes * PER_EPISODE
        and chaos["serving"] == calm["serving"] == {"policy": 2, "scorer": 2}
        and (not args.node_loss or len(chaos["node"]["recovery_s"]) == sum(map(len, held.values())) > 0)
    )
    date = datetime.date.today().isoformat()
    out = args.out or Path(__file__).parent / "results" / f"{date}-cpu{os.cpu_count()}-chaos.json"
    command = "python benchmarks/run.py chaos " + " ".join(argv)
    summary = {"command": command.strip(), "ok": ok, "episodes": args.episodes, "calm": calm, "chaos": chaos}
    out.write_text(json.dumps(summary, indent=1) + "\n")
    print(table(calm, chaos, args.episodes))
    sources = ", ".join(f"{n} from {s}" for s, n in sorted(Counter(chaos["rebuilt_from"]).items()))
    print(f"calm {calm['seconds']:.1f} s, with kills {chaos['seconds']:.1f} s ({chaos['redone']} episodes redone)")
    print(f"trainer rebuilds: {sources or 'none'}")
    print(f"{'passed' if ok else 'FAILED'}; {out}")
    return 0 if ok else 1
