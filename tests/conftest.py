"""The session's Ray cluster, and the shared helpers (``tests/helpers``) made importable from
every folder of tests.

The test folders mirror the package's wings (core, backends, pipeline, engine, tools) plus
``api`` for the public surface. They have no ``__init__.py``: pytest imports each test module as
a top-level module (rootdir import mode "prepend"), so basenames are unique across folders, and
flowrl ships the models a test module defines to Ray workers by value.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

HELPERS = Path(__file__).parent / "helpers"
# Ray starts its workers at nice 15 so that a driver stays responsive; here the workers are the
# replicas under test, and at nice 15 each gets ~3% of a core beside one busy process per core,
# so a loaded CI machine would starve them 30x. Set before any cluster starts (the fixture's and
# those of the `flowrl run` subprocesses, which inherit it).
os.environ.setdefault("RAY_worker_niceness", "0")
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

# The fuzzers (hypothesis): in the default run a fixed seed and a bounded budget, so CI is
# repeatable and short; FLOWRL_FUZZ=long for the longer run docs/reliability.md reports
# (FLOWRL_FUZZ_EXAMPLES cases per test, 20,000 by default; a new random seed each run).
settings.register_profile(
    "ci", derandomize=True, max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "long",
    max_examples=int(os.environ.get("FLOWRL_FUZZ_EXAMPLES", "20000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile("long" if os.environ.get("FLOWRL_FUZZ") == "long" else "ci")


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster per test session: 16 logical CPUs, 8 logical GPUs. Always a new
    one (``address="local"``): never a cluster someone else started on this machine."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=16, num_gpus=8, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
