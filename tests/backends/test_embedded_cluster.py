"""A pipeline with no cluster address starts a Ray cluster of its own, even while another one
runs on the machine (Ray's plain ``ray.init()`` would join that one, and refuse the CPU count
flowrl gives it with a bare ``ValueError``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import numpy as np, ray
    import flowrl
    from flowrl.testing import Scale

    model = Scale("m", {"num_replicas": 1, "batch_size": 2, "cpus_per_replica": 0.1}, srcs=["x"], dst="y")
    with flowrl.Pipeline(lambda x: model.forward_step(x)) as pipe:
        print("samples", len(pipe.run([{"x": np.ones(1)} for _ in range(4)])))
        print("gcs", ray.get_runtime_context().gcs_address)
    """
)


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
def test_a_pipeline_without_an_address_starts_its_own_cluster_beside_a_running_one():
    from ray.cluster_utils import Cluster

    # a cluster as `ray start` leaves one: Ray's plain init() finds it through its address file
    other = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    finally:
        other.shutdown()
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("samples", "gcs")))
    assert lines["samples"] == "4"
    assert lines["gcs"] != other.address  # a cluster of its own
