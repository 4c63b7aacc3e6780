"""Trainers over ``transformers`` models: GRPO and PPO for the policy, a value trainer.

One ``train_step`` is one optimizer step on this rank's shard of a global batch. Every loss
is normalised by counts of the whole global batch (its samples and response tokens, summed
over the data-parallel ranks), and gradients are summed over the ranks here: the step is the
same whatever the ranks and the micro-batches, and a user never averages gradients.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import torch

from .. import rl
from .._core.errors import ConfigError
from . import sharding
from .config import GRPO, LM, PPO, Optim, Train
from .models import Config, HFModel
from .targets import need, old_logprobs, ppo_targets, with_loss_mask
from .tokens import join, response_mask, response_values, right_pad, sequence_logprobs, token_micro_batches

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    from .._core.flow.batch import Batch
    from .loading import Head


class Counts:
    """Response tokens and samples of the whole global batch (all ranks)."""

    def __init__(self, tokens: int, sequences: int, max_tokens: int | None) -> None:
        self.tokens, self.sequences, self.max_tokens = tokens, sequences, max_tokens

    def kwargs(self) -> dict[str, Any]:
        return {"num_tokens": self.tokens, "num_sequences": self.sequences, "max_tokens": self.max_tokens}


class HFTrainer(HFModel):
    """Shared machinery: fp32 weights (bf16 autocast on a GPU), AdamW with a warm-up and
    decay schedule, micro-batches by token budget, gradient clipping, gradient sums over the
    data-parallel ranks. Subclasses give ``prepare`` (per-sample targets over the whole shard,
    e.g. advantages) and ``objective`` (a micro-batch's loss)."""

    def __init__(
        self,
        name: str,
        config: Config = None,
        *,
        lm: LM | Mapping[str, Any],
        optim: Optim | Mapping[str, Any] | None = None,
        train: Train | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(name, config, lm=lm)
        self.optim = _to(Optim, optim, name, "optim")
        self.train_config = _to(Train, train, name, "train")

    def setup(self) -> None:
        if self.lm.dtype == "auto":  # trainers keep fp32 weights; a GPU computes in bf16 autocast
            self.lm = _replace_dtype(self.lm)
        super().setup()
        self.module.train()
        if self.train_config.gradient_checkpointing:
            _body(self.module).gradient_checkpointing_enable()
        self.sharded = self.world_size > 1 and self.train_config.fsdp == "auto"
        if self.sharded:
            sharding.shard(self.module)
        o = self.optim
        self.optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: _lr_factor(o, step))

    # ---- subclass hooks ----
    def prepare(self, batch: Batch) -> dict[str, list[torch.Tensor] | torch.Tensor]:
        """Per-sample targets computed over the whole shard (e.g. group advantages)."""
        return {}

    def objective(self, mb: Batch, extra: Mapping[str, Any], counts: Counts) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    # ---- the step ----
    def train_step(self, batch: Batch, iteration: int) -> dict[str, float]:
        extra = self.prepare(batch) if len(batch) else {}
        counts = self.global_counts(batch)
        self.optimizer.zero_grad(set_to_none=False)
        totals: dict[str, float] = {}
        chunks = list(self.micro_batch_rows(batch))
        most = self.most_micro_batches(len(chunks))  # before any pass: collectives in one order on every rank
        for rows in chunks:
            mb = batch.select(rows)
            with self.autocast():
                loss, stats = self.objective(mb, _take(extra, rows), counts)
            loss.backward()  # type: ignore[no-untyped-call]
            for key, value in {"loss": float(loss.detach()), **stats}.items():
                totals[key] = totals.get(key, 0.0) + value * (len(rows) if key != "loss" else 1)
        for _ in range(most - len(chunks)):
            self.idle_pass()
        if not self.sharded:  # FSDP sums the gradients itself, in the backward pass
            self.all_reduce_grads(self.module)
        norm = self.clip_grads()
        self.optimizer.step()
        self.lr_scheduler.step()
        if self.train_config.empty_cache and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the step's cached activations, for the models sharing the GPU
        metrics = {k: (v if k == "loss" else v / max(1, len(batch))) for k, v in totals.items()}
        metrics["loss"] = self.summed(totals.get("loss", 0.0))  # each rank holds a part of the global loss
        if "score" in batch and len(batch):  # the rollout's mean reward: the learning curve
            metrics["score"] = float(torch.as_tensor(batch["score"]).float().mean())
        if len(batch):
            metrics["response_length"] = sum(len(r) for r in batch["response_ids"]) / len(batch)
        return {**metrics, "grad_norm": norm, "lr": float(self.lr_scheduler.get_last_lr()[0])}

    def global_counts(self, batch: Batch) -> Counts:
        kept = batch["loss_mask"] if "loss_mask" in batch else batch["response_ids"]  # the tokens a loss counts
        tokens = sum(int(torch.as_tensor(m).sum()) if "loss_mask" in batch else len(m) for m in kept)
        local = torch.tensor([tokens if len(batch) else 0, len(batch)])
        if self.world_size > 1:
            import torch.distributed as dist

            local = local.to(self.device)  # NCCL reduces GPU tensors only
            dist.all_reduce(local)
        return Counts(int(local[0]), int(local[1]), getattr(self.objective_config(), "max_tokens", None))

    def objective_config(self) -> object:
        return None

    def most_micro_batches(self, mine: int) -> int:
        """The most micro-batches any rank has in this step (a sharded model's ranks must all
        run as many forward and backward passes: each pass gathers the shards collectively)."""
        if not self.sharded:
            return mine
        import torch.distributed as dist

        most = torch.tensor([mine], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most)

    def idle_pass(self) -> None:
        """A forward and backward pass over one pad token that adds nothing to the gradients: a
        rank with fewer micro-batches (or an empty shard) joins the others' collectives."""
        ids = torch.full((1, 1), int(self.tokenizer.pad_token_id), device=self.device)
        with self.autocast():
            out = self.module(input_ids=ids, attention_mask=torch.ones_like(ids))
        (getattr(out, "logits", out).float().sum() * 0.0).backward()

    def summed(self, value: float) -> float:
        """``value`` summed over the data-parallel ranks."""
        if self.world_size <= 1:
            return value
        import torch.distributed as dist

        total = torch.tensor([value], dtype=torch.float64, device=self.device)  # NCCL reduces GPU tensors only
        dist.all_reduce(total)
        return float(total)

    def micro_batch_rows(self, batch: Batch) -> Iterator[list[int]]:
        if not len(batch):
            return
        lengths = [len(p) + len(r) for p, r in zip(batch["prompt_ids"], batch["response_ids"], strict=True)]
        yield from token_micro_batches(lengths, self.train_config.micro_batch_tokens, self.micro_batch_size)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda" and self.train_config.autocast == "auto":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def clip_grads(self) -> float:
        """The global gradient norm (over all ranks' shards), clipped to ``max_grad_norm``."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        limit = self.optim.max_grad_norm if self.optim.max_grad_norm is not None else float("inf")
        return sharding.norm(torch.nn.utils.clip_grad_norm_(params, limit)) if params else 0.0

    # ---- weights and checkpoints: a sharded model gathers them on every rank at once ----
    def get_weights(self) -> Mapping[str, Any]:
        if not self.sharded:
            return super().get_weights()
        if self.config.weight_transport == "host":  # rank 0 gathers them into host memory
            return sharding.full_weights(self.module, cpu=True)
        return sharding.Gathered(self.module)  # the transport gathers each as it packs it

    def checkpoint_state(self) -> Mapping[str, Any]:
        # whole weights and optimizer state keyed by parameter name, sharded or not: a run saved
        # on two FSDP ranks resumes on one rank, and the other way round
        return {
            "module": sharding.full_weights(self.module, cpu=True) if self.sharded else self.module.state_dict(),
            "optimizer": sharding.full_optimizer_state(self.module, self.optimizer),
            "lr_scheduler": self.lr_scheduler.state_dict(),
        }

    def restore_state(self, state: Mapping[str, Any]) -> None:
        sharding.load_full(self.module, self.optimizer, state)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def logprobs(self, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """This model's per-token log-probs of each response (with grad) and their mask."""
        padded = join(mb["prompt_ids"], mb["response_ids"], int(self.tokenizer.pad_token_id))
        logits = self.module(
            input_ids=padded.input_ids.to(self.device), attention_mask=padded.attention_mask.to(self.device)
        ).logits
        lp, mask = sequence_logprobs(logits, padded.to(self.device), self.train_config.temperature)
        return lp, with_loss_mask(mb, mask)


class GRPOTrainer(HFTrainer):
    """GRPO on the policy: advantages normalised within each prompt's group of samples
    (``RunConfig.num_samples_per_prompt``), the clipped surrogate, and an optional KL term
    to the reference (reads ``ref_logprobs`` when ``kl_coef > 0``)."""

    def __init__(
        self,
        name: str,
        config: Config = None,
        *,
        lm: LM | Mapping[str, Any],
        grpo: GRPO | Mapping[str, Any] | None = None,
        optim: Optim | Mapping[str, Any] | None = None,
        train: Train | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(name, config, lm=lm, optim=optim, train=train)
        self.grpo = _to(GRPO, grpo, name, "grpo")

    def objective_config(self) -> object:
        return self.grpo

    def prepare(self, batch: Batch) -> dict[str, list[torch.Tensor] | torch.Tensor]:
        if "prompt_index" not in batch:
            raise ConfigError(
                f"trainer {self.name!r}: GRPO compares the samples of one prompt; set "
                "RunConfig.num_samples_per_prompt to 2 or more"
            )
        scores = torch.as_tensor(batch["score"]).float()
        groups = torch.as_tensor(batch["prompt_index"])
        return {"advantage": rl.group_advantages(scores, groups, scale=self.grpo.scale)}

    def objective(self, mb: Batch, extra: Mapping[str, Any], counts: Counts) -> tuple[torch.Tensor, dict[str, float]]:
        g = self.grpo
        lp, mask = self.logprobs(mb)
        rollout = right_pad(mb["logprobs"]).to(lp) if "logprobs" in mb else None
        old, weights, stats = old_logprobs(g, lp, rollout, mask)
        adv = extra["advantage"].to(lp)
        loss, more = rl.policy_loss(
            lp,
            old,
            adv,
            mask,
            clip=g.clip,
            clip_high=g.clip_high,
            aggregation=g.aggregation,
            is_weights=weights,
            **counts.kwargs(),
        )
        stats = {**stats, **more}
        if g.kl_coef > 0:
            ref = right_pad(need(mb, "ref_logprobs", "GRPO.kl_coef > 0")).to(lp)
            kl = rl.kl_loss(lp, ref, mask, kind=g.kl, aggregation=g.aggregation, **counts.kwargs())
            loss = loss + g.kl_coef * kl
            stats = {**stats, "kl": float(kl.detach())}
        return loss, stats


class PPOTrainer(GRPOTrainer):
    """PPO on the policy: advantages by GAE over the value model's ``values`` and per-token
    rewards (the score at the last token, less the KL penalty to ``ref_logprobs``)."""

    def __init__(
        self,
        name: str,
        config: Config = None,
        *,
        lm: LM | Mapping[str, Any],
        ppo: PPO | Mapping[str, Any] | None = None,
        optim: Optim | Mapping[str, Any] | None = None,
        train: Train | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(name, config, lm=lm, optim=optim, train=train)
        self.ppo = _to(PPO, ppo, name, "ppo")
        p = self.ppo
        self.grpo = GRPO(
            clip=p.clip,
            clip_high=p.clip_high,
            aggregation=p.aggregation,
            old_logprobs=p.old_logprobs,
            tis_cap=p.tis_cap,
        )

    def objective_config(self) -> object:
        return self.ppo

    def prepare(self, batch: Batch) -> dict[str, list[torch.Tensor] | torch.Tensor]:
        adv, _ = ppo_targets(batch, self.ppo)
        return {"advantage_rows": adv}

    def objective(self, mb: Batch, extra: Mapping[str, Any], counts: Counts) -> tuple[torch.Tensor, dict[str, float]]:
        return super().objective(mb, {"advantage": right_pad(extra["advantage_rows"])}, counts)


class ValueTrainer(HFTrainer):
    """The value model of PPO: regresses ``values`` onto the GAE returns, clipped around the
    values the rollout saw (``PPO.value_clip``)."""

    head: Head = "value"

    def __init__(
        self,
        name: str,
        config: Config = None,
        *,
        lm: LM | Mapping[str, Any],
        ppo: PPO | Mapping[str, Any] | None = None,
        optim: Optim | Mapping[str, Any] | None = None,
        train: Train | Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(name, config, lm=lm, optim=optim, train=train)
        self.ppo = _to(PPO, ppo, name, "ppo")

    def objective_config(self) -> object:
        return self.ppo

    def prepare(self, batch: Batch) -> dict[str, list[torch.Tensor] | torch.Tensor]:
        _, returns = ppo_targets(batch, self.ppo)
        return {"returns": returns}

    def objective(self, mb: Batch, extra: Mapping[str, Any], counts: Counts) -> tuple[torch.Tensor, dict[str, float]]:
        padded = join(mb["prompt_ids"], mb["response_ids"], int(self.tokenizer.pad_token_id))
        per_position = self.module(padded.input_ids.to(self.device), padded.attention_mask.to(self.device))
        values = response_values(per_position.float(), padded.to(self.device))  # fp32 under bf16 autocast
        mask = with_loss_mask(mb, response_mask(padded.response_lengths, values.shape[1]).to(values))
        old, returns = right_pad(mb["values"]).to(values), right_pad(extra["returns"]).to(values)
        p = self.ppo
        loss = rl.value_loss(
            values, old, returns, mask, clip=p.value_clip, aggregation=p.aggregation, **counts.kwargs()
        )
        return loss, {}


def _take(extra: Mapping[str, Any], rows: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in extra.items():
        out[key] = value[torch.tensor(rows)] if isinstance(value, torch.Tensor) else [value[i] for i in rows]
    return out


def _to(cls: Any, value: Any, model: str, key: str) -> Any:
    from .._core.settings.config import to_config

    return to_config(cls, value, f"model {model!r} {key}")


def _replace_dtype(lm: LM) -> LM:
    import msgspec

    return msgspec.structs.replace(lm, dtype="float32")


def _body(module: torch.nn.Module) -> Any:
    return getattr(module, "body", module)


def _lr_factor(o: Optim, step: int) -> float:
    """The learning rate's multiple at optimizer step ``step`` (warm-up, then the decay)."""
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - o.warmup_steps) / max(1, o.total_steps - o.warmup_steps))
    shape = 1 - progress if o.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * shape
