"""Run by test_partial_rollouts.py: an engine with a partial-rollout loop, writing a checkpoint
after every episode into argv[1], killed in the middle of a turn of episode argv[2] (in a call
that continues samples); in process, or on the Ray cluster at address argv[3] when given."""

from __future__ import annotations

import sys

from _loop_models import engine


def main() -> None:
    folder, die_at = sys.argv[1], int(sys.argv[2])
    backend = "inprocess"
    if len(sys.argv) > 3:
        import ray

        ray.init(address=sys.argv[3], log_to_driver=False)
        backend = "ray"
    engine(backend, die_in=(die_at, folder), checkpoint={"every": 1, "dir": folder}).learn()


if __name__ == "__main__":
    sys.exit(main())
