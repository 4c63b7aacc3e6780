"""While Ray actors start, each one not ready says which step it is in and what it waits for,
every ``PipelineConfig.startup_report_s``, long before ``setup_timeout_s``. Real actors on the
session's cluster: one held in ``setup()`` by a gate, one that cannot be scheduled while a
placement group holds every GPU, one whose gate never opens."""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl.testing import Scale, flowrl_actor_names

REPORT = {"startup_report_s": 0.2, "progress": "off"}


class Said(logging.Handler):
    """The flowrl logger's messages; ``seen`` is set once one contains ``wanted``."""

    def __init__(self, wanted: str) -> None:
        super().__init__(logging.INFO)
        self.wanted, self.seen, self.messages = wanted, threading.Event(), []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if self.wanted in message:
            self.seen.set()


@pytest.fixture
def said():
    handlers = []

    def listen(wanted: str) -> Said:
        handler = Said(wanted)
        logging.getLogger("flowrl").addHandler(handler)
        handlers.append(handler)
        return handler

    level = logging.getLogger("flowrl").level
    logging.getLogger("flowrl").setLevel(logging.INFO)
    yield listen
    for handler in handlers:
        logging.getLogger("flowrl").removeHandler(handler)
    logging.getLogger("flowrl").setLevel(level)


class GatedSetup(Scale):
    """A Scale whose setup() waits until the named actor ``gate`` opens."""

    def setup(self) -> None:
        import ray

        ray.get(ray.get_actor("startup-gate", namespace="tests").wait.remote())


@pytest.fixture
def gate(ray_cluster):
    """The named actor GatedSetup waits on (shut until ``open``); gone after the test, however it ends."""

    class Gate:  # defined here, so that Ray ships it by value
        def __init__(self) -> None:
            self.opened = asyncio.Event()

        async def wait(self) -> None:
            await self.opened.wait()

        async def open(self) -> None:
            self.opened.set()

    actor = ray_cluster.remote(Gate).options(name="startup-gate", namespace="tests").remote()
    yield actor
    ray_cluster.kill(actor)


def run_in_thread(model: Scale, config: dict[str, Any]) -> Any:
    items = [{"x": np.zeros(1)} for _ in range(4)]
    return ThreadPoolExecutor(1).submit(flowrl.run_flow, model.forward_step, items, config)


def test_a_replica_in_setup_says_for_how_long_and_where_it_runs(ray_cluster, said, gate) -> None:
    heard = said("slow[0] setup() running for")
    run = run_in_thread(GatedSetup("slow", {"batch_size": 2, "cpus_per_replica": 0.1}), REPORT)
    assert heard.seen.wait(120), heard.messages  # reported while setup() still waits on the gate
    ray_cluster.get(gate.open.remote())
    out, _ = run.result(timeout=120)
    assert len(out) == 4
    (report, *_) = [m for m in heard.messages if "setup() running for" in m]
    assert "0 of 1 ready" in report and "(pid " in report and "GPUs []" in report, report
    # once ready, where its start's time went
    assert any(m.startswith("start-up: slow[0] ready in ") and "setup() " in m for m in heard.messages)
    assert flowrl_actor_names() == []


def test_a_replica_not_scheduled_says_what_it_waits_for(ray_cluster, said) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    every_gpu = placement_group([{"GPU": 8, "CPU": 0.1}])
    ray_cluster.get(every_gpu.ready(), timeout=60)
    heard = said("gpu[0] not scheduled after")
    try:
        run = run_in_thread(Scale("gpu", {"batch_size": 2, "cpus_per_replica": 0.1, "gpus_per_replica": 1}), REPORT)
        assert heard.seen.wait(120), heard.messages
    finally:
        remove_placement_group(every_gpu)  # now it can start
    out, _ = run.result(timeout=120)
    assert len(out) == 4
    (report, *_) = [m for m in heard.messages if "not scheduled after" in m]
    assert "it asks for 1 GPU and 0.1 CPU; the cluster has 0 of 8 GPU" in report, report
    assert flowrl_actor_names() == []


def test_a_replica_that_never_comes_up_is_reported_then_refused_by_name(ray_cluster, said, gate) -> None:
    heard = said("stuck[0] ")
    stuck = GatedSetup("stuck", {"batch_size": 2, "cpus_per_replica": 0.1})
    with pytest.raises(flowrl.ClusterError, match=r"replicas stuck\[0\] did not start within .*setup_timeout_s=5.0s"):
        run_in_thread(stuck, {**REPORT, "setup_timeout_s": 5.0}).result(timeout=120)
    assert heard.seen.is_set(), heard.messages  # said so before the timeout (the gate never opens)
    assert flowrl_actor_names() == []


def test_the_report_interval_is_checked() -> None:
    with pytest.raises(flowrl.ConfigError, match="startup_report_s"):
        flowrl.PipelineConfig(startup_report_s=-1)
