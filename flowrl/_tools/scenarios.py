"""The load test's workloads: the scenarios, and a flow of sleeping models that runs one.

Model time is a sleep (standing in for GPU time, so two CPU cores are not the bottleneck): a
step of n samples sleeps ``call_s + n * per_sample_s + max(tails of its samples)``, and a call
``shard_s`` more before its steps (``begin_shard``), the same
per-sample times the simulator uses (less the OS's measured lateness in waking a sleeper,
``sleep_slack``, so that a step lasts its nominal time on a quiet machine). Items are
``{"k": sample, "e": epoch}``; the first stage also returns each sample's tail as
``<stage>_length``, the response length a length memory learns from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from .._core.flow.model import Model
from .._sim.simulate import INPUT, SimStage, StageCost, Workload, tails
from .baselines import model_sleep, nominal_sleep, sleep_slack

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._core.flow.batch import Batch
    from .._core.flow.node import Node

# Scenarios run for several epochs over the same prompts (the length memory's case), and how many.
EPOCHS = {"heavy-tail-epochs": 3}


def scenarios() -> dict[str, Workload]:
    """The scenarios of the performance issues, deterministic from their seeds."""
    scorer = StageCost(call_s=0.010, per_sample_s=0.002)
    policy = StageCost(call_s=0.020, tail_median_s=0.020, tail_sigma=0.8)

    def rlhf(
        samples: int, policy_r: int, policy_b: int, down_r: int, down_b: int, seed: int, cost: StageCost = policy
    ) -> Workload:
        def wide(name: str, inputs: list[str]) -> SimStage:
            return SimStage(name=name, inputs=inputs, replicas=down_r, batch_size=down_b, cost=scorer)

        return Workload(
            samples=samples,
            seed=seed,
            stages=[
                SimStage(name="policy", replicas=policy_r, batch_size=policy_b, cost=cost),
                wide("reference", ["policy"]),
                wide("value", ["policy"]),
                wide("reward", ["policy", "reference", "value"]),
            ],
        )

    heavy = StageCost(call_s=0.020, tail_median_s=0.030, tail_sigma=1.2)
    tiny = StageCost(call_s=0.001, per_sample_s=0.0005)
    heavy_tail = rlhf(256, 4, 16, 8, 8, seed=1, cost=heavy)
    # launch-bound calls: most of a call's time is fixed, whatever its size (issue 22)
    launch = StageCost(call_s=0.015, per_sample_s=0.0005)
    generate = StageCost(call_s=0.030, per_sample_s=0.001, tail_median_s=0.010, tail_sigma=0.6)
    # scorers of batch size 1 whose call costs a third of a step once, however many steps it
    # holds: push sends each upstream batch to one replica as one call of several steps (issue 42)
    one = StageCost(call_s=0.030, shard_s=0.010)
    answers = StageCost(call_s=0.020, tail_median_s=0.050, tail_sigma=0.8)
    return {
        "chatlearn-209": rlhf(16, 2, 4, 8, 2, seed=209),
        "heavy-tail-256": heavy_tail,
        # the same, each prompt carrying an estimate of its cost (off by a log-normal factor, sigma 0.5)
        "heavy-tail-256-hinted": msgspec.structs.replace(heavy_tail, cost_hint_sigma=0.5),
        "prime-97": Workload(
            samples=97,
            seed=7,
            stages=[
                SimStage(name="policy", replicas=7, batch_size=5, cost=policy),
                SimStage(name="reward", inputs=["policy"], replicas=3, batch_size=7, cost=scorer),
            ],
        ),
        "tiny-shards": Workload(
            samples=400,
            seed=3,
            stages=[
                SimStage(name="a", replicas=4, batch_size=1, cost=tiny),
                SimStage(name="b", inputs=["a"], replicas=4, batch_size=1, cost=tiny),
            ],
        ),
        "fixed-call-cost": Workload(
            samples=256,
            seed=13,
            stages=[
                SimStage(name="policy", replicas=4, batch_size=32, cost=generate),
                SimStage(name="reference", inputs=["policy"], replicas=16, batch_size=16, cost=launch),
                SimStage(name="reward", inputs=["policy", "reference"], replicas=16, batch_size=16, cost=launch),
            ],
        ),
        "batch1-scorers": Workload(
            samples=256,
            seed=42,
            stages=[
                SimStage(name="policy", replicas=4, batch_size=8, cost=StageCost(call_s=0.010, per_sample_s=0.001)),
                SimStage(name="reference", inputs=["policy"], replicas=4, batch_size=1, cost=one),
                SimStage(name="reward", inputs=["policy", "reference"], replicas=4, batch_size=1, cost=one),
            ],
        ),
        # the same scorers behind a policy whose answers end at long-tailed lengths, 6 replicas of
        # each scorer for 4 of the policy: the upstream batches do not divide evenly among them
        "batch1-scorers-tail": Workload(
            samples=256,
            seed=42,
            stages=[
                SimStage(name="policy", replicas=4, batch_size=8, cost=answers),
                SimStage(name="reference", inputs=["policy"], replicas=6, batch_size=1, cost=one),
                SimStage(name="reward", inputs=["policy", "reference"], replicas=6, batch_size=1, cost=one),
            ],
        ),
        # GRPO-like: 64 prompts x 4 samples, each prompt's length the same every epoch but for
        # a log-normal noise (sigma 0.3); run for EPOCHS epochs, the scheduler fed by a memory
        "heavy-tail-epochs": msgspec.structs.replace(heavy_tail, seed=22, group=4, epoch_noise=0.3),
    }


class Sleeper(Model):
    """A stage of a workload: sleeps its call time; samples are indexed by the input field ``k``
    and the epoch by ``e``; the first stage reports each sample's tail as its length."""

    def __init__(
        self, name: str, config: dict[str, Any], cost: StageCost, tail: dict[int, np.ndarray], first: bool = False
    ) -> None:
        super().__init__(name, config)
        self.cost, self.tail, self.first = cost, tail, first

    def setup(self) -> None:
        sleep_slack()

    def begin_shard(self, batch: Batch) -> None:
        nominal_sleep(self.cost.shard_s)

    def forward_step(self, batch: Batch, iteration: int) -> dict[str, Any]:
        k = np.asarray(batch["k"], dtype=np.int64)
        tail = self.tail[int(batch["e"][0])]
        model_sleep(self.cost, tail, k)
        out: dict[str, Any] = {f"{self.name}_done": [True] * len(k)}
        if self.first:
            out[f"{self.name}_length"] = tail[k].tolist()
        return out


def epoch_tails(w: Workload, epochs: int) -> dict[str, dict[int, np.ndarray]]:
    """Per stage, per epoch, the samples' tails."""
    per = [tails(msgspec.structs.replace(w, epoch=e)) for e in range(epochs)]
    return {st.name: {e: per[e][st.name] for e in range(epochs)} for st in w.stages}


def workload_flow(w: Workload, epochs: int = 1) -> Callable[[Node], tuple[Node, ...]]:
    tail = epoch_tails(w, epochs)
    models: dict[str, Model] = {
        st.name: Sleeper(
            st.name,
            {
                "num_replicas": st.replicas,
                "batch_size": st.batch_size,
                "splitter": st.splitter,
                "prefetch": st.prefetch,
                "shard_micro_batches": st.shard_micro_batches,
                "cpus_per_replica": 0.05,
            },
            st.cost,
            tail[st.name],
            first=st is w.stages[0],
        )
        for st in w.stages
    }

    def flow(x: Node) -> tuple[Node, ...]:
        nodes = {INPUT: x}
        for st in w.stages:
            nodes[st.name] = models[st.name].forward_step(*[nodes[i] for i in st.inputs])
        return tuple(nodes[st.name] for st in w.stages if not any(st.name in o.inputs for o in w.stages))

    return flow


def items(w: Workload, epoch: int = 0, hints: np.ndarray | None = None) -> list[dict[str, Any]]:
    """The input items of one epoch (with ``cost`` estimates, when the workload has some)."""
    if hints is None:
        return [{"k": i, "e": epoch} for i in range(w.samples)]
    return [{"k": i, "e": epoch, "cost": float(hints[i])} for i in range(w.samples)]
