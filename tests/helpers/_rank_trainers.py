"""Trainers for the data-parallel checks, and the function each spawned rank of a real gloo
group runs (importable, as the "spawn" start method needs): every case's steps through
``TrainerRuntime``, as a trainer actor runs them, with the weights after each step saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import flowrl
from flowrl._backends.trainer_runtime import TrainerRuntime

SAMPLES, STEPS = 8, 3


def x_of(batch: flowrl.Batch) -> torch.Tensor:
    return torch.as_tensor(np.asarray(batch["x"], dtype=np.float32)).reshape(len(batch), 2)


class AutoTrainer(flowrl.Model):
    """Least squares towards y = x0 - x1 by SGD; never sums its gradients itself: flowrl does,
    before ``optimizer.step()``. The loss is summed over samples over the global batch size."""

    def setup(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.2)

    def loss(self, batch: flowrl.Batch) -> torch.Tensor:
        x = x_of(batch)
        return ((self.module(x).squeeze(1) - (x[:, 0] - x[:, 1])) ** 2).sum() / self.global_batch_size

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self.optimizer.zero_grad()
        self.loss(batch).backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        return {"weights": [float(v) for v in torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])]}


class UnreducedTrainer(AutoTrainer):
    """The same trainer with the automatic sum turned off, and none of its own: ranks diverge."""

    auto_reduce_grads = False


class UnseededTrainer(AutoTrainer):
    """The same trainer, every rank starting from weights of its own."""

    def setup(self) -> None:
        torch.manual_seed(self.rank + 1)
        self.module = torch.nn.Linear(2, 1)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.2)


class ManualTrainer(AutoTrainer):
    """Sums its gradients itself with ``all_reduce_grads`` (as the examples and flowrl.hf do),
    then steps two optimizers (the weight's and the bias's): nothing is summed twice."""

    def setup(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(2, 1)
        self.optimizers = [
            torch.optim.SGD([self.module.weight], lr=0.2),
            torch.optim.SGD([self.module.bias], lr=0.2),
        ]

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        for opt in self.optimizers:
            opt.zero_grad()
        self.loss(batch).backward()  # type: ignore[no-untyped-call]
        self.all_reduce_grads(self.module)
        for opt in self.optimizers:
            opt.step()
        return {"weights": [float(v) for v in torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])]}


class PerMicroBatchTrainer(AutoTrainer):
    """Steps the optimizer once per micro-batch of the same size on every rank: each step's
    gradients are summed again (2 ranks with micro-batches of 2 step as 1 rank with 4)."""

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        for mb in self.micro_batches(batch):
            self.optimizer.zero_grad()
            (self.loss(mb) * self.global_batch_size / (len(mb) * self.world_size)).backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
        return {"weights": [float(v) for v in torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])]}


class DDPTrainer(AutoTrainer):
    """Wraps its module in DistributedDataParallel, which averages the gradients over the ranks
    itself: flowrl leaves them alone (summed again, the step would be twice as long)."""

    def setup(self) -> None:
        super().setup()
        if self.world_size > 1:
            self.module = torch.nn.parallel.DistributedDataParallel(self.module)
            self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.2)


class State:
    """A plain helper object holding the trainer's module and optimizer (no ``self.module``)."""

    def __init__(self, net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.net, self.opt = net, opt


class HeldTrainer(AutoTrainer):
    """``AutoTrainer`` with its module and optimizer held in ``self.state``: flowrl still finds
    the optimizer (to sum its gradients) and the module (to compare the ranks' weights)."""

    def setup(self) -> None:
        torch.manual_seed(0)
        net = torch.nn.Linear(2, 1)
        self.state = State(net, torch.optim.SGD(net.parameters(), lr=0.2))

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        net, opt = self.state.net, self.state.opt
        opt.zero_grad()
        x = x_of(batch)
        (((net(x).squeeze(1) - (x[:, 0] - x[:, 1])) ** 2).sum() / self.global_batch_size).backward()  # type: ignore[no-untyped-call]
        opt.step()
        return {"weights": [float(v) for v in torch.cat([p.detach().reshape(-1) for p in net.parameters()])]}


TRAINERS: dict[str, type[AutoTrainer]] = {
    "held": HeldTrainer,
    "auto": AutoTrainer,
    "manual": ManualTrainer,
    "per-micro-batch": PerMicroBatchTrainer,
    "ddp": DDPTrainer,
    "unreduced": UnreducedTrainer,
    "unseeded": UnseededTrainer,
}


def dataset() -> list[dict[str, Any]]:
    g = np.random.default_rng(0)
    return [{"x": g.normal(size=2).astype(np.float32)} for _ in range(SAMPLES)]


def shard(rank: int, world: int) -> flowrl.Batch:
    """Rank ``rank``'s consecutive share of the global batch (all of it with one rank)."""
    rows = dataset()
    size = SAMPLES // world
    ids = list(range(rank * size, (rank + 1) * size))
    return flowrl.Batch.from_samples(ids, [rows[i] for i in ids])


def train(name: str, rank: int, world: int, init: str | None, micro_batch: int) -> list[dict[str, Any]]:
    """``STEPS`` steps of trainer ``name`` on this rank's shard, through the trainer runtime."""
    runtime = TrainerRuntime(TRAINERS[name](name, {"num_replicas": world}), rank, world)
    runtime.setup(init, [], "local", 60.0)
    batch = shard(rank, world)
    return [runtime.train(batch, SAMPLES, micro_batch, step) for step in range(STEPS)]


def rank_main(rank: int, world: int, folder: str) -> None:
    """One rank of a gloo group: every case in turn (a new group each), results saved."""
    torch.set_num_threads(1)
    out = {}
    for i, name in enumerate(TRAINERS):
        init = Path(folder, f"store-{i}").as_uri()
        out[name] = train(name, rank, world, init, micro_batch=2)
        dist.barrier()
        dist.destroy_process_group()
    torch.save(out, Path(folder, f"rank{rank}.pt"))


class AmpTrainer(AutoTrainer):
    """Mixed precision with a GradScaler under the automatic gradient sum: refused at setup,
    since a rank whose scaler found inf skips optimizer.step() and the sum there."""

    def setup(self) -> None:
        super().setup()
        self.scaler = torch.amp.GradScaler("cpu")


def amp_main(rank: int, world: int, folder: str) -> None:
    """One rank of a gloo group: ``AmpTrainer``'s setup; the error it raised, saved."""
    torch.set_num_threads(1)
    runtime = TrainerRuntime(AmpTrainer("amp", {"num_replicas": world}), rank, world)
    try:
        runtime.setup(Path(folder, "group").as_uri(), [], "local", 60.0)
        said = "no error"
    except flowrl.FlowError as err:
        said = f"{type(err).__name__}: {err}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(folder, f"rank{rank}.txt").write_text(said)


HF_STEPS = 2
HF_CASES = {"all_reduce_grads": "never", "fsdp": "auto"}  # how the hf trainer's gradients are summed


def hf_samples(tokenizer: str) -> list[dict[str, Any]]:
    """Two groups of four responses (one group per rank), the rollout's log-probs a little off."""
    import hf_ranks

    g = torch.Generator().manual_seed(0)
    samples = []
    for prompt_index in range(2):
        prompt = torch.randint(5, 300, (5,), generator=g)
        for _ in range(4):
            response = torch.randint(5, 300, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
            samples.append({"prompt_ids": prompt, "response_ids": response, "prompt_index": prompt_index})
            samples[-1]["score"] = float(torch.randint(0, 4, (1,), generator=g))
    trainer = hf_ranks.make_trainer(tokenizer, hf_case("never"))
    with torch.no_grad():
        own, _ = trainer.logprobs(flowrl.Batch.from_samples(list(range(len(samples))), samples))
    for row, sample in zip(own, samples, strict=True):
        sample["logprobs"] = (
            row[: len(sample["response_ids"])] - 0.05 * torch.rand(len(row), generator=g)[: len(sample["response_ids"])]
        )
    return samples


def hf_case(fsdp: str) -> dict[str, Any]:
    return {
        "aggregation": "token-mean",
        "micro_batch_tokens": 0,
        "micro_batch": 3,
        "lr": 1e-3,
        "eps": 1e-6,
        "global_batch": 8,
        "fsdp": fsdp,
    }


def hf_rank_main(rank: int, world: int, folder: str) -> None:
    """One rank of a gloo group: per case, a GRPO trainer stepped by hand (``train_step``, as
    ``test_hf_training`` checks it against one rank) and one stepped through the trainer runtime
    (its optimizer hooked): their weights and gradient norms, saved."""
    import hf_ranks

    torch.set_num_threads(1)
    job = torch.load(Path(folder, "job.pt"))
    dist.init_process_group("gloo", init_method=Path(folder, "group").as_uri(), rank=rank, world_size=world)
    rows = list(range(rank * 4, rank * 4 + 4))
    batch = flowrl.Batch.from_samples(rows, [job["samples"][i] for i in rows])
    out: dict[str, Any] = {}
    try:
        for name, fsdp in HF_CASES.items():
            case = hf_case(fsdp)
            by_hand = hf_ranks.make_trainer(job["tokenizer"], case, rank, world)
            norms = [by_hand.train_step(batch, 0)["grad_norm"] for _ in range(HF_STEPS)]
            hooked = hf_ranks.make_trainer(job["tokenizer"], case, rank, world)
            runtime = TrainerRuntime(hooked, rank, world)
            steps = [runtime.train(batch, case["global_batch"], case["micro_batch"], 0) for _ in range(HF_STEPS)]
            out[name] = {
                "by_hand": ({k: v.detach().clone() for k, v in by_hand.get_weights().items()}, norms),
                "hooked": (
                    {k: v.detach().clone() for k, v in hooked.get_weights().items()},
                    [s["grad_norm"] for s in steps],
                ),
                "checksums": (steps[0]["_weights_before"], steps[0]["_weights_after"]),
            }
        torch.save(out, Path(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
