"""Deterministic mode on a GPU (docs/reproducibility.md): an MLP on CUDA in replicas, in process
and on Ray. Prints, per layout and mode, whether the replicas ran torch's deterministic
algorithms with ``CUBLAS_WORKSPACE_CONFIG`` set (cuBLAS refuses deterministic matmuls without
it), and whether each sample's outputs are bitwise equal to the first layout's.

    PYTHONPATH=$PWD:/tmp/site python3 benchmarks/gpu/deterministic_check.py
"""

from __future__ import annotations

import os
from typing import Any

import torch

import flowrl


class Net(flowrl.Model):
    def setup(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, 1024),
            torch.nn.GELU(),
            torch.nn.Linear(1024, 1024),
            torch.nn.GELU(),
            torch.nn.Linear(1024, 8),
        ).cuda()

    @flowrl.step
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        x = torch.stack([torch.randn(256, generator=g) for g in batch.generators()]).cuda()
        with torch.no_grad():
            y = self.net(x).cpu()
        flag = torch.are_deterministic_algorithms_enabled()
        env = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")
        return {"y": y.tolist(), "flag": [flag] * len(batch), "env": [env] * len(batch)}


def run(backend: str, replicas: int, batch: int, deterministic: bool) -> tuple[list[Any], set[Any]]:
    net = Net("net", {"num_replicas": replicas, "batch_size": batch, "gpus_per_replica": 0.2, "cpus_per_replica": 0.5})
    config = {"backend": backend, "deterministic": deterministic, "progress": "off", "inprocess_threads": True}
    samples, _ = flowrl.run_flow(net.forward_step, [{"i": i} for i in range(61)], config)
    return [s["y"] for s in samples], {(s["flag"], s["env"]) for s in samples}


def main() -> None:
    print(torch.cuda.get_device_name(0), torch.__version__)
    for deterministic in (True, False):
        layouts = [("inprocess", 1, 16), ("inprocess", 3, 16), ("ray", 2, 16), ("ray", 3, 5)]
        first = None
        for backend, replicas, batch in layouts:
            ys, seen = run(backend, replicas, batch, deterministic)
            first = ys if first is None else first
            head = f"deterministic={deterministic} {backend} {replicas} x {batch}"
            print(f"{head}: flag/env {sorted(seen)}, equal to the first layout: {ys == first}")
            if backend == "inprocess":
                torch.use_deterministic_algorithms(False)


if __name__ == "__main__":
    main()
