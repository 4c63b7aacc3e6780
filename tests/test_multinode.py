"""Replicas placed across two simulated nodes (``ray.cluster_utils.Cluster``), joined by address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _run_script(name: str) -> dict:
    """Run a test script in a separate process (this one may already be attached to the
    session's local cluster); its last line of output is its result, as JSON."""
    script = Path(__file__).with_name(name)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_replicas_spread_over_two_nodes_of_an_existing_cluster():
    result = _run_script("_multinode_script.py")
    assert result["ok"] and result["samples"] == 20
    assert len(result["nodes"]) == 2
    assert sorted(set(result["placement"])) == result["nodes"]  # both nodes host replicas
    assert result["live_during"] == 4 and result["left_after"] == []
    assert "model 'wide' needs 0.5 CPU and 3 GPU on one node, but the largest node has 2 CPU and 2 GPU" in result["node_fit"]


def test_a_node_removed_mid_run_loses_no_sample_and_the_run_completes_on_the_other():
    result = _run_script("_node_loss_script.py")
    assert result["ok"] and result["samples"] == 48  # every sample once, counted once
    assert result["retried"] >= 1  # the removed node's replicas held shards, which ran again
    on_head = sorted(r for r, node in enumerate(result["placement"]) if node == result["head"])
    assert len(on_head) == 2 and set(result["worked_after"]) <= set(on_head)
    assert result["left_after"] == []
