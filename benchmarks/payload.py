"""Big payloads through three stages: flowrl against the same bytes moved by plain Ray calls.

Each sample makes a payload of ``mib`` MiB in stage ``a``; stage ``b`` reads it and writes one
of the same size; stage ``c`` reads that and writes one number, the only field the driver
fetches. Reported: throughput (MiB of payload written per second) and how much the driver's
memory grew during the run, for a small and a big payload.

    python benchmarks/payload.py
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import numpy as np
import ray

from flowrl import Model, open_pipeline

SAMPLES = 48
REPLICAS = 2


class Make(Model):
    def __init__(self, name: str, config: dict[str, Any], floats: int) -> None:
        super().__init__(name, config)
        self.floats = floats

    def forward_step(self, batch: Any, iteration: int) -> dict[str, Any]:
        return {"a": np.stack([np.full(self.floats, float(k), dtype=np.float32) for k in batch["k"]])}


class Pass(Model):
    def forward_step(self, batch: Any, iteration: int) -> dict[str, Any]:
        return {"b": np.asarray(batch["a"]) + 1.0}


class Reduce(Model):
    def forward_step(self, batch: Any, iteration: int) -> dict[str, Any]:
        return {"c": np.asarray(batch["b"]).sum(axis=1)}


@ray.remote
class _Plain:
    def make(self, k: int, n: int) -> np.ndarray:
        return np.full(n, float(k), dtype=np.float32)

    def add(self, a: np.ndarray) -> np.ndarray:
        return a + 1.0

    def reduce(self, b: np.ndarray) -> float:
        return float(b.sum())


def _rss() -> int:
    with open("/proc/self/statm") as f:  # Linux: resident pages are the second number
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """The driver's resident memory, sampled every 10 ms while a run goes on."""

    def __enter__(self) -> _PeakRss:
        self._stop = threading.Event()
        self.base = self.peak = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth_mib(self) -> float:
        return (self.peak - self.base) / 2**20


async def run_flowrl(mib: float) -> dict[str, float]:
    floats = int(mib * 2**20 / 4)
    cfg = {"num_replicas": REPLICAS, "batch_size": 2, "cpus_per_replica": 0.05}
    a, b, c = Make("a", cfg, floats), Pass("b", cfg), Reduce("c", cfg)
    items = [{"k": i} for i in range(SAMPLES)]
    async with open_pipeline(lambda x: c.forward_step(b.forward_step(a.forward_step(x)))) as pipe:
        await pipe.run(items[:4], fields=["c"])
        with _PeakRss() as rss:
            start = time.perf_counter()
            out = await pipe.run(items, fields=["c"])
            wall = time.perf_counter() - start
    assert [float(s["c"]) for s in out] == [float((k + 1) * floats) for k in range(SAMPLES)]
    return {"mib_per_s": 2 * SAMPLES * mib / wall, "rss_growth_mib": rss.growth_mib}


def run_plain(mib: float) -> dict[str, float]:
    floats = int(mib * 2**20 / 4)
    actors = [[_Plain.options(num_cpus=0.05).remote() for _ in range(REPLICAS)] for _ in range(3)]
    ray.get([x.reduce.remote(np.zeros(1)) for group in actors for x in group])
    with _PeakRss() as rss:
        start = time.perf_counter()
        outs = []
        for k in range(SAMPLES):
            r = k % REPLICAS
            outs.append(actors[2][r].reduce.remote(actors[1][r].add.remote(actors[0][r].make.remote(k, floats))))
        ray.get(outs)
        wall = time.perf_counter() - start
    for group in actors:
        for x in group:
            ray.kill(x)
    return {"mib_per_s": 2 * SAMPLES * mib / wall, "rss_growth_mib": rss.growth_mib}


def section(sizes: tuple[float, ...] = (0.25, 4.0)) -> str:
    lines = [
        "## Big payloads",
        "",
        f"`python benchmarks/payload.py`: {SAMPLES} samples through three stages of {REPLICAS} replicas "
        "(a writes the payload, b reads it and writes one as big, c reduces it to a number); MiB/s counts the",
        "payload bytes written per second; plain Ray is the same chain of actor calls with object references.",
        "",
        "| MiB per sample | flowrl MiB/s | plain Ray MiB/s | flowrl / plain | flowrl driver RSS growth MiB "
        "| plain driver RSS growth MiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for mib in sizes:
        flow = asyncio.run(run_flowrl(mib))
        plain = run_plain(mib)
        lines.append(
            f"| {mib:g} | {flow['mib_per_s']:.0f} | {plain['mib_per_s']:.0f} | "
            f"{flow['mib_per_s'] / plain['mib_per_s']:.2f} | {flow['rss_growth_mib']:.0f} | "
            f"{plain['rss_growth_mib']:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    try:
        print(section())
    finally:
        ray.shutdown()
