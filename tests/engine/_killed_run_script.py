"""Run by test_checkpoint.py: an engine on the test's Ray cluster (address in argv[1]) writing
a checkpoint after every episode into argv[2], whose process is killed (os._exit) in the
middle of episode argv[3]. Prints one JSON line per episode it finished: its samples and steps."""

from __future__ import annotations

import json
import os
import sys

import ray
from _resume_models import make_engine, trained


def main() -> None:
    address, folder, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ray.init(address=address, log_to_driver=False)
    engine, seen = make_engine(checkpoint={"every": 1, "dir": folder, "keep": 0})
    relay = engine._learning.relay_fn

    def relay_then_die(episodes):
        out = relay(episodes)
        if episodes[-1].episode_id == kill_at:  # mid-episode: rolled out, not trained
            done = trained(engine)
            for e in range(kill_at):
                print(json.dumps({"seen": seen[e], "trained": done[e]}), flush=True)
            os._exit(1)
        return out

    engine.set_relay_sample_fn(relay_then_die)
    engine.learn()


if __name__ == "__main__":
    sys.exit(main())
