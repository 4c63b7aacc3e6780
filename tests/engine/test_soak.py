"""Soak (slow, not in the default run): 200 small episodes of an engine on the local cluster.
Driver memory and object-store use stay flat; no actor or placement group outlives the engine.

    python -m pytest -q -m slow tests/engine/test_soak.py -s     # prints the figures of docs/reliability.md
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import flowrl
from flowrl.testing import CountingTrainer, Scale, flowrl_actor_names

EPISODES = int(__import__("os").environ.get("SOAK_EPISODES", 200))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _plasma_mib() -> float:
    import ray
    from ray._private.internal_api import memory_summary

    # this session's cluster, by address: another one running on the machine is not ours to read
    address = ray.get_runtime_context().gcs_address
    found = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(address=address, stats_only=True))
    return float(found.group(1)) if found else float("nan")


def _flowrl_groups(ray) -> int:
    return sum(1 for pg in ray.util.placement_group_table().values() if pg.get("state") == "CREATED")


@pytest.mark.slow
def test_two_hundred_episodes_keep_memory_flat_and_leave_nothing_behind(ray_cluster, tmp_path):
    ray = ray_cluster
    groups_before = _flowrl_groups(ray)
    gpu = {"gpus_per_replica": 1, "cpus_per_replica": 0.1}  # each model through its placement group
    policy = Scale("policy", {"num_replicas": 2, "batch_size": 4, **gpu}, srcs=["x"], dst="y")
    reward = Scale("reward", {"num_replicas": 2, "batch_size": 4, **gpu}, srcs=["y"], dst="r")
    trainer = CountingTrainer("trainer", {"num_replicas": 2, **gpu})
    engine = flowrl.Engine(
        rollout=lambda x: reward.forward_step(policy.forward_step(x)),
        train=[trainer],
        sync=[(trainer, policy)],
        config={
            "sample_per_episode": 16,
            "num_episode": EPISODES,
            "train_global_batch_size": 16,
            "max_relay_episode": 2,
            "checkpoint": {"dir": str(tmp_path), "every": 20},
        },
    )
    rss, plasma = [], []

    def relay(episodes):
        rss.append(_rss_mib())
        if len(rss) % 5 == 0:
            plasma.append(_plasma_mib())
        return episodes[-1].buffer

    engine.set_relay_sample_fn(relay)
    engine.set_dataset([{"x": np.full(16384, float(i))} for i in range(1000)])  # 128 KiB a sample: via shared memory
    with engine:
        stats = engine.learn()
        groups_during = _flowrl_groups(ray) - groups_before
    assert len(stats.episodes) == EPISODES and stats.trainers["trainer"].steps == EPISODES
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"episode-{EPISODES - 20:06d}", f"episode-{EPISODES:06d}"]
    warm, last = float(np.median(rss[40:60])), float(np.median(rss[-20:]))
    print(
        f"\nsoak: {EPISODES} episodes; driver RSS median at episodes 40-60 {warm:.1f} MiB, last 20 {last:.1f} MiB "
        f"(growth {last - warm:+.1f} MiB); placement groups during "
        f"{groups_during}, after {_flowrl_groups(ray) - groups_before}; actors after {len(flowrl_actor_names())}"
    )
    assert last - warm < 16.0  # flat: no growth with the episode count beyond noise
    # Shared memory holds the episodes in flight (freed as their references drop), never the run's history:
    # 200 episodes of 16 samples x 3 fields of 128 KiB would be 1.2 GiB. The samples swing with where an
    # episode is when sampled; their trend over the run must stay within that swing.
    trend = float(np.polyfit(np.arange(len(plasma)) * 5, plasma, 1)[0]) * EPISODES
    print(
        f"soak: object store {min(plasma):.0f}-{max(plasma):.0f} MiB, median {np.median(plasma):.0f} MiB; "
        f"fitted trend {trend:+.1f} MiB over the run"
    )
    assert abs(trend) < 40.0 and max(plasma) < 160.0
    assert groups_during == 3 and _flowrl_groups(ray) == groups_before
    assert flowrl_actor_names() == []
