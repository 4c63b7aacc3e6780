from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster per test session: 16 logical CPUs, 8 logical GPUs."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=16, num_gpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
