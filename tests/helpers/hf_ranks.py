"""Helpers of hf/test_hf_training.py: a GRPO trainer over a tiny Llama set up as flowrl's
runtime sets up a trainer rank, the training of one shard, the function a spawned process of a
real gloo group runs (importable, as the "spawn" start method needs), and a rule reward."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import hf_tiny
import torch
import torch.distributed as dist

import flowrl
from flowrl import hf
from flowrl._backends.weight_share import Sender, read_all
from flowrl.hf import sharding

Samples = tuple[list[int], list[dict[str, Any]]]  # ids, and each sample's fields


def e_count(prompt: str, response: str, **_: Any) -> float:
    """A reward that depends on the response: how many letters "e" it has."""
    return float(response.count("e"))


PROMPTS = ["what is one", "the answer", "seven plus", "nine minus two"]


def grpo_engine(
    policy: flowrl.Model, reward: flowrl.Model, trainer: flowrl.Model, config: flowrl.RunConfig
) -> flowrl.Engine:
    """policy -> reward, the trainer syncing into the policy, over ``PROMPTS`` four times."""
    engine = flowrl.Engine(
        rollout=lambda p: reward.forward_step(policy.forward_step(p)),
        train=[trainer],
        sync=[(trainer, policy)],
        config=config,
    )
    engine.set_dataset([{"prompt": p} for p in PROMPTS] * 4)
    return engine


def make_trainer(tokenizer: str, case: dict[str, Any], rank: int = 0, world_size: int = 1) -> hf.GRPOTrainer:
    """A GRPO trainer as ``TrainerRuntime`` makes one: rank and sizes set, then ``setup()`` (after
    the process group, when there is one)."""
    trainer = hf.GRPOTrainer(
        "grpo",
        lm=hf.LM(config=hf_tiny.llama(), tokenizer=tokenizer),
        grpo={"aggregation": case["aggregation"]},
        optim={"lr": case["lr"], "eps": case["eps"]},
        train={"micro_batch_tokens": case["micro_batch_tokens"], "fsdp": case["fsdp"]},
    )
    trainer.rank, trainer.world_size, trainer.replica_id = rank, world_size, rank
    trainer.global_batch_size, trainer.micro_batch_size = case["global_batch"], case["micro_batch"]
    trainer.setup()
    return trainer


def train(trainer: hf.GRPOTrainer, shard: Samples, steps: int) -> dict[str, Any]:
    """``steps`` train steps on ``shard``: the weights after them, each step's metrics and
    (rank 0) the checkpoint state."""
    batch = flowrl.Batch.from_samples(*shard)
    metrics = [trainer.train_step(batch, 0) for _ in range(steps)]
    # every rank gathers (a sharded trainer's weights are split over the ranks); rank 0 gets them whole
    weights = {k: v.detach().clone() for k, v in trainer.get_weights().items()}
    state = trainer.checkpoint_state()  # collective too; rank 0's is what a checkpoint keeps
    sent = broadcast_snapshot(trainer)
    return {"weights": weights, "metrics": metrics, "state": state if trainer.rank == 0 else None, "sent": sent}


def broadcast_snapshot(trainer: hf.GRPOTrainer) -> dict[str, torch.Tensor] | None:
    """The weights as ``weight_transport="nccl"`` snapshots them on rank 0 (a sharded trainer's
    gathered one tensor at a time while packed; the other ranks read along), and rank 0's
    snapshot as tensors; None on the other ranks."""
    weights = sharding.Gathered(trainer.module) if trainer.sharded else trainer.get_weights()
    if trainer.rank != 0:
        read_all(weights)
        return None
    sender = Sender()
    return sender.values(sender.snapshot(weights, trainer.name).snapshot)


def rank_main(rank: int, world_size: int, folder: str) -> None:
    """One rank of a gloo group (``torch.multiprocessing.spawn``'s target): for each case of
    ``folder/job.pt``, a fresh trainer trains on this rank's shard; the weights and metrics go to
    ``folder/rank<rank>.pt``, one entry per case."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    where = Path(folder)
    job = torch.load(where / "job.pt")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{where / 'group'}",  # a fresh file: no port to collide on
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=300),  # a lost peer fails the test instead of hanging it
    )
    try:
        out = []
        for case in job["cases"]:
            trainer = make_trainer(job["tokenizer"], case, rank, world_size)
            out.append(train(trainer, case.get("shards", job["shards"])[rank], job["steps"]))
        torch.save(out, where / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
