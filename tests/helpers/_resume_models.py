"""Deterministic models for the engine tests (imported by engine/test_checkpoint.py,
test_async.py, test_engine_resize.py and by the killed-run script): a numpy policy fed by a torch
trainer with Adam, whose loss draws from the rank's torch generator, so only an exact restore of
weights, optimiser state, generators, relay buffer and sampler reproduces the uninterrupted run."""

from __future__ import annotations

import os
import select
import time
from pathlib import Path
from typing import Any

import numpy as np

import flowrl

CPU = {"cpus_per_replica": 0.1}


class Policy(flowrl.Model):
    def __init__(
        self, name: str, config: Any = None, *, sleep_s: float = 0.0, report: Any = None, gate: Any = None
    ) -> None:
        super().__init__(name, config)
        self.sleep_s = sleep_s  # per shard: a rollout that takes time
        self.report = report  # a ray.util.queue.Queue: (replica, samples) put after each shard
        self.gate = gate  # a ray.util.queue.Queue of permits: each shard takes one before it runs

    def setup(self) -> None:
        self.w = np.full(4, 0.5, dtype=np.float32)
        self.b = np.zeros(1, dtype=np.float32)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        if self.gate is not None:
            self.gate.get()  # blocks until the test hands out a permit
        time.sleep(self.sleep_s)
        x = np.asarray(batch["prompt"], dtype=np.float32)
        out = {"action": x @ self.w + self.b[0] + np.float32(iteration)}
        if self.report is not None:  # the test awaits these instead of polling the engine's counters
            self.report.put((self.replica_id, len(batch)))
        return out

    def get_weights(self) -> dict[str, Any]:
        return {"weight": self.w[None, :].copy(), "bias": self.b.copy()}

    def set_weights(self, weights: Any) -> None:
        self.w = np.asarray(weights["weight"], dtype=np.float32).reshape(-1)
        self.b = np.asarray(weights["bias"], dtype=np.float32).reshape(-1)


class Learner(flowrl.Model):
    """One Adam step per global batch; dies once (``die_at``: episode, rank) if asked, at the
    start of its step or, with ``after_sum``, once its gradients are summed over the ranks; and
    with ``again_in_setup`` once more, in the setup of the rank started in its place."""

    def __init__(
        self,
        name: str,
        config: Any = None,
        *,
        die_at: tuple[int, int] | None = None,
        marker: str = "",
        peer_first: bool = False,
        sleep_s: float = 0.0,
        again_in_setup: bool = False,
        after_sum: bool = False,
    ) -> None:
        super().__init__(name, config)
        self.after_sum = after_sum
        self.sleep_s = sleep_s  # per step: a trainer that takes time
        self.again_in_setup = again_in_setup
        self.die_at = die_at
        self.marker = marker
        self.peer_first = peer_first  # the other ranks report a broken collective before the death is seen

    def setup(self) -> None:
        import torch

        if self.die_at and self.die_at[1] == self.rank and not Path(self.marker).exists():
            Path(self.marker + ".pid").write_text(str(os.getpid()))  # the peer waits for this process to end
        again = Path(self.marker + ".setup")
        if self.again_in_setup and self.die_at and self.die_at[1] == self.rank and Path(self.marker).exists():
            if not again.exists():
                again.touch()
                os._exit(1)  # the rank started in place of the dead one dies before it is set up
        torch.manual_seed(0)
        self.module = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=0.05)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        import torch

        if not self.after_sum:
            self.maybe_die(iteration)  # its peer then waits in the all-reduce
        peer = Path(self.marker + ".peer")
        if self.peer_first and self.die_at and self.die_at[0] == iteration and not peer.exists():
            wait_for_exit(int(Path(self.marker + ".pid").read_text()))  # until the rank dies
            peer.touch()
            raise RuntimeError("[gloo] Connection closed by peer")  # what a collective raises then
        time.sleep(self.sleep_s)
        x = torch.as_tensor(np.asarray(batch["prompt"], dtype=np.float32))
        y = torch.as_tensor(np.asarray(batch["action"], dtype=np.float32))
        self.optimizer.zero_grad()
        noise = torch.rand(len(batch))  # from this rank's generator, which a checkpoint keeps
        loss = (((self.module(x).squeeze(1) - y) ** 2) * noise).sum() / self.global_batch_size
        loss.backward()
        self.all_reduce_grads(self.module)
        if self.after_sum:
            self.maybe_die(iteration)  # its peer goes on: the sum is done
        self.optimizer.step()
        seen = {k: np.asarray(batch[k]).tolist() for k in ("idx", "policy_version", "policy_staleness") if k in batch}
        return {
            "ids": batch.ids.tolist(),
            "loss": float(loss.detach()),
            "w": self.module.weight.detach().numpy().ravel().tolist(),
            **seen,
        }

    def maybe_die(self, iteration: int) -> None:
        if self.die_at == (iteration, self.rank) and not Path(self.marker).exists():
            Path(self.marker).touch()
            os._exit(1)


def wait_for_exit(pid: int, bound_s: float = 120.0) -> None:
    """Until process ``pid`` has ended: its pidfd turns readable then (an event, not a poll);
    ``bound_s`` only keeps a lost process from hanging the test."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # ended already
    try:
        ended, _, _ = select.select([fd], [], [], bound_s)
    finally:
        os.close(fd)
    if not ended:
        raise TimeoutError(f"process {pid} still runs after {bound_s} s")


def dataset() -> list[dict[str, Any]]:
    return [{"idx": i, "prompt": np.arange(4, dtype=np.float32) * (i % 7) / 7 + i / 20} for i in range(20)]


def make_engine(
    *,
    policy_replicas: int = 2,
    ranks: int = 2,
    die_at: tuple[int, int] | None = None,
    marker: str = "",
    peer_first: bool = False,
    again_in_setup: bool = False,
    after_sum: bool = False,
    rollout_s: float = 0.0,
    train_s: float = 0.0,
    report: Any = None,
    gate: Any = None,
    **config: Any,
) -> tuple[flowrl.Engine, list[dict[str, Any]]]:
    """The engine and the list its relay function appends each episode's samples to
    (``rollout_s`` / ``train_s``: seconds each policy shard / train step sleeps; ``report``: a
    ``ray.util.queue.Queue`` the policy replicas put ``(replica, samples)`` into per shard;
    ``gate``: a ``Queue`` each policy shard takes a permit from first)."""
    policy = Policy(
        "policy",
        {"num_replicas": policy_replicas, "batch_size": 2, **CPU},
        sleep_s=rollout_s,
        report=report,
        gate=gate,
    )
    learner = Learner(
        "learner",
        {"num_replicas": ranks, **CPU},
        die_at=die_at,
        marker=marker,
        peer_first=peer_first,
        sleep_s=train_s,
        again_in_setup=again_in_setup,
        after_sum=after_sum,
    )
    cfg = {
        "sample_per_episode": 8,
        "num_episode": 6,
        "train_global_batch_size": 4,
        "train_micro_batch_size": 2,
        "num_training_epoch": 2,
        "shuffle": True,
        "seed": 3,
        "sync_every": 2,
        "max_relay_episode": 2,
        **config,
    }
    evaluate = cfg.get("eval_every", 0)
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[learner],
        sync=[(learner, policy)],
        config=cfg,
        eval_flow=(lambda x: policy.forward_step(x)) if evaluate else None,
    )
    seen: list[dict[str, Any]] = []

    def relay(episodes: list[flowrl.EpisodeBuffer]) -> list[flowrl.Sample]:
        last = episodes[-1]
        seen.append(
            {
                "episode": last.episode_id,
                "ids": [s.id for s in last.buffer],
                "idx": [int(s["idx"]) for s in last.buffer],
                "action": [float(s["action"]) for s in last.buffer],
            }
        )
        # the last episode whole, and the even ids of the one before: training reads the relay buffer
        return [s for e in episodes for s in e.buffer if e is last or s.id % 2 == 0]

    engine.set_relay_sample_fn(relay)
    engine.set_dataset(dataset())
    if evaluate:
        engine.set_eval_dataset(dataset()[:3])
    return engine, seen


def trained(engine: flowrl.Engine) -> list[list[list[dict[str, Any]]]]:
    """Per episode of this engine object: per step, per rank, (ids, loss, weights after)."""
    return [
        [[{k: r[k] for k in ("ids", "loss", "w")} for r in step] for step in ep["learner"]]
        for ep in engine.train_results
    ]
