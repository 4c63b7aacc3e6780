"""Weight sync of a ~100M-parameter model between two Ray actors on one GPU: through Ray's
object store (what flowrl does today: numpy arrays in host memory) against CUDA IPC (the
receiver maps the sender's GPU buffer and copies it on the GPU).

It also tries NCCL (a torch.distributed group of the two actors, which Ray Direct Transport's
nccl transport builds on too) and prints its broadcast time or what NCCL answers two ranks on
one GPU.

    python3 benchmarks/gpu/weight_sync.py [--repeats 5]     # on a GPU machine, Ray installed
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import SIZES, VOCAB, build  # noqa: E402


@ray.remote
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
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        torch.cuda.synchronize()
        del flat
        return self.checksum()

    # ---- NCCL: a torch.distributed group of the two actors ----
    def nccl(self, rank: int, port: int) -> float:
        """Broadcast the weights from rank 0 to rank 1 in one flat buffer (joining the group on
        the first call); rank 1 loads them. The checksum of the weights held after it."""
        import datetime

        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(
                "nccl",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=2,
                timeout=datetime.timedelta(seconds=60),
            )
        params = list(self.module.parameters())
        with torch.no_grad():
            flat = (
                torch.cat([p.detach().reshape(-1) for p in params])
                if rank == 0
                else torch.empty(sum(p.numel() for p in params), device="cuda")
            )
            dist.broadcast(flat, src=0)
            offset = 0
            for p in params if rank else []:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        torch.cuda.synchronize()
        return self.checksum()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nccl_ready(trainer: Any, policy: Any, port: int) -> str | None:
    """Form the NCCL group with a first broadcast; None, or what NCCL answered (on one GPU it
    refuses two ranks)."""
    try:
        ray.get([trainer.nccl.remote(0, port), policy.nccl.remote(1, port)], timeout=120)
        return None
    except Exception as err:
        lines = [ln for ln in str(err).splitlines() if "NCCL" in ln or "Duplicate" in ln or "Error" in ln]
        return f"{type(err).__name__}: {' | '.join(lines[-3:]) or str(err)[-300:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--apart",
        action="store_true",
        help="trainer and policy on two GPUs (CUDA IPC is then left out: each actor sees only its own GPU)",
    )
    args = parser.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    gpus = 1 if args.apart else 0.5
    paths = {
        "object store (numpy, host memory)": ("as_numpy", "load_numpy"),
        **({} if args.apart else {"CUDA IPC (GPU to GPU)": ("as_ipc", "load_ipc")}),
    }
    try:
        trainer, policy = Holder.options(num_gpus=gpus).remote(), Holder.options(num_gpus=gpus).remote()
        params = ray.get(trainer.params.remote())
        port = free_port()
        refused = nccl_ready(trainer, policy, port)
        if refused is None:
            paths["NCCL broadcast (torch.distributed)"] = ("nccl", "")
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, (send, load) in paths.items():
                want = ray.get(trainer.perturb.remote())

                def sync(send: str = send, load: str = load) -> float:
                    if send == "nccl":
                        return ray.get([trainer.nccl.remote(0, port), policy.nccl.remote(1, port)])[1]
                    out = ray.get(getattr(trainer, send).remote())
                    return ray.get(getattr(policy, load).remote(out[0] if isinstance(out, list) else out))

                start = time.perf_counter()
                got = sync()
                times[name].append(time.perf_counter() - start)
                assert abs(got - want) <= 1e-6 * max(1.0, abs(want)), (name, got, want)
    finally:
        ray.shutdown()
    where = "on two GPUs" if args.apart else "on one GPU"
    print(
        f"{params / 1e6:.1f}M parameters (fp32, {params * 4 / 2**20:.0f} MiB), trainer and policy actors {where}; "
        f"medians of {args.repeats}, each checked by the receiver's checksum"
    )
    print("| path | s | GiB/s |\n| --- | --- | --- |")
    for name, ts in times.items():
        s = statistics.median(ts)
        print(f"| {name} | {s:.3f} | {params * 4 / 2**30 / s:.2f} |")
    if refused:
        print(f"NCCL {where} failed: {refused}")


if __name__ == "__main__":
    main()
