"""Weight sync of a ~100M-parameter model between two Ray actors on one GPU: through Ray's
object store (what flowrl does today: numpy arrays in host memory) against CUDA IPC (the
receiver maps the sender's GPU buffer and copies it on the GPU).

NCCL (a torch.distributed group, or Ray Direct Transport's nccl transport) refuses two ranks
on one GPU, so on a colocated GPU the choice is host memory or CUDA IPC.

    python3 benchmarks/gpu/weight_sync.py [--repeats 5]     # on a GPU machine, Ray installed
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scaled import SIZES, VOCAB, build  # noqa: E402


@ray.remote(num_gpus=0.5)
class Holder:
    def __init__(self) -> None:
        self.module = build(VOCAB, SIZES["full"], 128).cuda()
        self.keep: torch.Tensor | None = None  # the flat copy a receiver maps, alive until the next

    def params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.module.parameters()))

    def perturb(self) -> float:
        with torch.no_grad():
            for p in self.module.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
        return self.checksum()

    # ---- through the object store: numpy in host memory ----
    def as_numpy(self) -> list[Any]:
        torch.cuda.synchronize()
        return [ray.put({k: v.detach().cpu().numpy() for k, v in self.module.state_dict().items()})]

    def load_numpy(self, weights: dict[str, Any]) -> float:
        self.module.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
        torch.cuda.synchronize()
        return self.checksum()

    # ---- CUDA IPC: a handle to one flat GPU buffer ----
    def as_ipc(self) -> Any:
        from torch.multiprocessing.reductions import reduce_tensor

        with torch.no_grad():
            self.keep = torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])
        torch.cuda.synchronize()
        return reduce_tensor(self.keep)

    def load_ipc(self, handle: Any) -> float:
        rebuild, args = handle
        flat = rebuild(*args)  # the sender's buffer, mapped (no copy yet)
        offset = 0
        with torch.no_grad():
            for p in self.module.parameters():
                p.copy_(flat[offset: offset + p.numel()].view_as(p))
                offset += p.numel()
        torch.cuda.synchronize()
        del flat
        return self.checksum()


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        trainer, policy = Holder.remote(), Holder.remote()
        params = ray.get(trainer.params.remote())
        times: dict[str, list[float]] = {"object store (numpy, host memory)": [], "CUDA IPC (GPU to GPU)": []}
        for _ in range(args.repeats):
            for name, send, load in (("object store (numpy, host memory)", "as_numpy", "load_numpy"),
                                     ("CUDA IPC (GPU to GPU)", "as_ipc", "load_ipc")):
                want = ray.get(trainer.perturb.remote())

                def sync(send: str = send, load: str = load) -> None:
                    out = ray.get(getattr(trainer, send).remote())
                    ref = out[0] if isinstance(out, list) else out
                    got = ray.get(getattr(policy, load).remote(ref))
                    assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (name, got, want)

                times[name].append(timed(sync))
    finally:
        ray.shutdown()
    print(f"{params / 1e6:.1f}M parameters (fp32, {params * 4 / 2**20:.0f} MiB), trainer and policy actors on one GPU; "
          f"medians of {args.repeats}, each checked by the receiver's checksum")
    print("| path | s | GiB/s |\n| --- | --- | --- |")
    for name, ts in times.items():
        s = statistics.median(ts)
        print(f"| {name} | {s:.3f} | {params * 4 / 2**30 / s:.2f} |")


if __name__ == "__main__":
    main()
