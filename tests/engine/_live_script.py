"""Run by test_live_view.py (under a pseudo-terminal, or with pipes): a synchronous learn() of
1000 episodes that writes a checkpoint after each into argv[1], on backend argv[2] ("ray": the
backend starts a cluster of its own, as in the examples), until Ctrl-C."""

from __future__ import annotations

import signal
import sys

import numpy as np

import flowrl
from flowrl.testing import CountingTrainer, Scale


def main() -> None:
    # a test runner started in the background by a shell hands its children SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    folder, backend = sys.argv[1], sys.argv[2]
    cpu = {"cpus_per_replica": 0.25}
    policy = Scale("policy", {"num_replicas": 2, "batch_size": 2, **cpu}, srcs=["x"], dst="y", sleep_s=0.02)
    trainer = CountingTrainer("trainer", {"num_replicas": 2 if backend == "ray" else 1, **cpu})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={
            "sample_per_episode": 8,
            "num_episode": 1000,
            "train_global_batch_size": 8,
            "checkpoint": {"every": 1, "dir": folder},
            "pipeline": {"backend": backend},
        },
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(64)])
    engine.learn()


if __name__ == "__main__":
    main()
