"""Run by test_interrupt.py: a synchronous learn() on its own Ray cluster (argv[2] "with": in
`with engine:`), writing a checkpoint after every episode into argv[1], interrupted with SIGINT
(Ctrl-C) once the third episode's rollout is done. Prints what was left after the interrupt:
actors, and the last checkpoint."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import numpy as np
import ray

import flowrl
from flowrl._core.training.state_format import CheckpointFolders, decode_state
from flowrl.testing import CountingTrainer, Scale, flowrl_actor_names


def last_checkpoint(folder: str) -> dict:
    """The latest checkpoint's episode and files, every file read back; hidden leftovers."""
    latest = CheckpointFolders(folder).latest()
    assert latest is not None
    files = sorted(p.name for p in latest.iterdir())
    for name in files:
        if name.endswith(".msgpack"):
            decode_state((latest / name).read_bytes())
    episode = json.loads((latest / "engine.json").read_text())["episode"]
    return {"episode": episode, "files": files, "hidden": [p.name for p in Path(folder).iterdir() if p.name[0] == "."]}


def main() -> None:
    # Ctrl-C reaches a program in a terminal's foreground; a test runner started in the
    # background by a shell script (a CI job's `cmd &`) hands its children SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    policy = Scale(
        "policy", {"num_replicas": 2, "batch_size": 2, "cpus_per_replica": 0.25}, srcs=["x"], dst="y", sleep_s=0.02
    )
    trainer = CountingTrainer("trainer", {"num_replicas": 2, "cpus_per_replica": 0.25})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={
            "sample_per_episode": 8,
            "num_episode": 1000,
            "train_global_batch_size": 8,
            "checkpoint": {"every": 1, "dir": sys.argv[1]},
        },
    )

    def relay(episodes):
        if episodes[-1].episode_id == 2:
            print("rolling", flush=True)  # the test sends SIGINT now
        return episodes[-1].buffer

    engine.set_relay_sample_fn(relay)
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(64)])
    try:
        if sys.argv[2] == "with":  # learn() through the portal of an open engine
            with engine:
                engine.learn()
        else:
            engine.learn()
        outcome = "finished"
    except KeyboardInterrupt as err:
        # Python prints no chain for it: no cause, and no context or one suppressed (`from None`)
        chained = err.__cause__ is not None or (err.__context__ is not None and not err.__suppress_context__)
        outcome = "chained" if chained else "interrupted"
    print(
        json.dumps({"outcome": outcome, "left": flowrl_actor_names(), "checkpoint": last_checkpoint(sys.argv[1])}),
        flush=True,
    )
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
