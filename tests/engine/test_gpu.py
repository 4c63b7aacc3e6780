"""On a real CUDA GPU (marked ``gpu``, skipped without one): models placed on cuda, tensors
through the object store between actors on one GPU, weight sync trainer -> policy on the GPU
(through host memory, and by CUDA IPC), a colocated replica that dies replaced on the GPU, and
all six PPO models colocated on one GPU with fractional GPU resources.

    python -m pytest -q -m gpu tests/engine/test_gpu.py        # benchmarks/gpu/run.sh tests runs it

These tests start their own Ray cluster with the machine's real GPUs, so run them in a pytest
session of their own (the default session's cluster has 8 logical GPUs)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flowrl  # noqa: E402
from flowrl.testing import flowrl_actor_names  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def gpu_cluster():
    import ray

    ray.init(num_cpus=16, num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def gpu(share: float, **extra: Any) -> dict[str, Any]:
    return {"gpus_per_replica": share, "cpus_per_replica": 0.1, **extra}


class Where(flowrl.Model):
    """Computes ``src @ w`` on its device; reports the device and its GPU ids. ``cuda_out``:
    the result stays a CUDA tensor (else numpy)."""

    def __init__(self, name: str, config: Any, *, src: str = "x", cuda_out: bool = False) -> None:
        super().__init__(name, config)
        self.src, self.cuda_out = src, cuda_out

    def setup(self) -> None:
        self.w = torch.full((4, 4), 0.5, device=self.device)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        x = torch.as_tensor(np.asarray(batch[self.src], dtype=np.float32), device=self.device)
        y = x @ self.w
        return {
            f"{self.name}_y": y if self.cuda_out else y.cpu().numpy(),
            f"{self.name}_device": [str(y.device)] * len(batch),
            f"{self.name}_gpus": [tuple(self.gpu_ids)] * len(batch),
        }


class Reader(flowrl.Model):
    """Reads the upstream CUDA tensor: where it arrived, and its values doubled on this GPU."""

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        y = batch["a_y"]
        arrived = str(y.device) if hasattr(y, "device") else type(y).__name__
        z = torch.as_tensor(y).to(self.device) * 2
        return {"z": z.cpu().numpy(), "arrived": [arrived] * len(batch), "b_device": [str(z.device)] * len(batch)}


def test_replicas_compute_on_cuda_and_cuda_tensors_travel_between_actors_on_one_gpu(gpu_cluster):
    a = Where("a", gpu(0.25, num_replicas=2, batch_size=4), cuda_out=True)
    b = Reader("b", gpu(0.25, num_replicas=2, batch_size=4))
    xs = [{"x": np.arange(4, dtype=np.float32) + i} for i in range(32)]
    out, stats = flowrl.run_flow(lambda x: b.forward_step(a.forward_step(x)), xs, {"progress": "off"})
    assert len(out) == 32 and flowrl_actor_names() == []
    for i, s in enumerate(out):
        expected = (np.arange(4, dtype=np.float32) + i) @ np.full((4, 4), 0.5, dtype=np.float32)
        assert s["a_device"].startswith("cuda") and s["b_device"].startswith("cuda") and s["arrived"].startswith("cuda")
        np.testing.assert_allclose(s["z"], 2 * expected, rtol=1e-5)
    assert {s["a_gpus"] for s in out} == {(0,)}  # both replicas share the one GPU
    assert stats.stages["b.forward_step"].samples == 32


class Policy(flowrl.Model):
    def setup(self) -> None:
        self.module = torch.nn.Linear(4, 1).to(self.device)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        with torch.no_grad():
            x = torch.as_tensor(np.asarray(batch["x"], dtype=np.float32), device=self.device)
            y = self.module(x).squeeze(1)
        weight = self.module.weight.detach()
        return {
            "y": y.cpu().numpy(),
            "w_sum": [float(weight.sum())] * len(batch),
            "w_device": [str(weight.device)] * len(batch),
        }


class Trainer(flowrl.Model):
    def setup(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(4, 1).to(self.device)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        x = torch.as_tensor(np.asarray(batch["x"], dtype=np.float32), device=self.device)
        loss = (self.module(x).squeeze(1) - 1).pow(2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return {"w_sum": float(self.module.weight.detach().sum()), "device": str(self.module.weight.device)}


def sync_and_probe(policy: Policy, trainer: Trainer, **config: Any) -> tuple[flowrl.Engine, list[Any]]:
    """3 episodes, then one more rollout: what each replica computes with after the last sync."""
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={"sample_per_episode": 8, "num_episode": 3, "progress": "off", **config},
    )
    engine.set_dataset([{"x": np.ones(4, dtype=np.float32) * (i % 3)} for i in range(24)])
    with engine:
        engine.learn()
        after = engine._session.deployment.rollout  # the engine's own pool, for a direct check
        samples = engine._portal.call(after.run, [{"x": np.ones(4, dtype=np.float32)} for _ in range(8)])
    return engine, samples


def assert_synced(engine: flowrl.Engine, samples: list[Any]) -> None:
    """Every replica holds the weights the trainer had after episode 3, on the GPU."""
    trained = [ep["trainer"][-1][0]["w_sum"] for ep in engine.train_results]
    assert all(ep["trainer"][-1][0]["device"].startswith("cuda") for ep in engine.train_results)
    assert {s["w_device"] for s in samples} <= {"cuda:0"}
    assert {round(s["w_sum"], 5) for s in samples} == {round(trained[-1], 5)}
    assert samples[0]["policy_version"] == 3 and flowrl_actor_names() == []


@pytest.mark.parametrize("transport", ["host", "cuda_ipc"])
def test_weight_sync_from_a_gpu_trainer_reaches_every_gpu_policy_replica(gpu_cluster, transport):
    policy = Policy("policy", gpu(0.25, num_replicas=2, batch_size=4))
    assert_synced(*sync_and_probe(policy, Trainer("trainer", gpu(0.25, weight_transport=transport))))


def die_once(marks: str) -> None:
    """This process exits, the first time over the run (an exclusive marker file in ``marks``;
    defined here, not imported from a helper: a model's module reaches Ray workers by value)."""
    try:
        os.close(os.open(os.path.join(marks, "died"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    os._exit(1)


class DiesOnce(Policy):
    """Replica 0's process exits in its second call, once over the run (a marker file)."""

    def __init__(self, name: str, config: Any, *, marks: str) -> None:
        super().__init__(name, config)
        self.marks = marks

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self.calls = getattr(self, "calls", 0) + 1
        if self.replica_id == 0 and self.calls == 2:
            die_once(self.marks)
        return super().forward_step(batch, iteration)


@pytest.mark.parametrize("transport", ["host", "cuda_ipc"])
def test_a_colocated_policy_replica_that_dies_is_replaced_on_the_gpu_with_the_trainer_s_weights(
    gpu_cluster, tmp_path, transport
):
    """The policy and its trainer share the GPU's one placement bundle: the replacement takes the
    dead replica's share of it, gets the trainer's weights (by CUDA IPC too) and serves."""
    policy = DiesOnce("policy", gpu(0.25, num_replicas=2, batch_size=4), marks=str(tmp_path))
    trainer = Trainer("trainer", gpu(0.25, weight_transport=transport))
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={"sample_per_episode": 8, "num_episode": 3, "progress": "off", "colocation": [["policy", "trainer"]]},
    )
    engine.set_dataset([{"x": np.ones(4, dtype=np.float32) * (i % 3)} for i in range(24)])
    with engine:
        engine.learn()
        rollout = engine._session.deployment.rollout
        engine._portal.call(rollout.healed)
        serving = rollout.serving("policy")
        samples = engine._portal.call(rollout.run, [{"x": np.ones(4, dtype=np.float32)} for _ in range(16)])
    assert (tmp_path / "died").exists()
    # replaced once; the replacement serves (it got the weights before its first shard)
    assert [e.model for e in engine.stats().replaced] == ["policy"] and serving == [1, 2]
    assert_synced(engine, samples)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_weight_sync_between_two_gpus(gpu_cluster):
    policy = Policy("policy", gpu(1.0, num_replicas=1, batch_size=4))
    assert_synced(*sync_and_probe(policy, Trainer("trainer", gpu(1.0, weight_transport="nccl"))))


class DiesInStep(Trainer):
    """Rank 1's process exits at the start of its third train step, once over the run (a marker)."""

    def __init__(self, name: str, config: Any, *, marks: str | None) -> None:
        super().__init__(name, config)
        self.marks = marks

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        self.calls = getattr(self, "calls", 0) + 1
        if self.marks is not None and self.rank == 1 and self.calls == 3:
            die_once(self.marks)
        return super().train_step(batch, iteration)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_trainer_rank_that_dies_on_its_gpu_is_rebuilt_from_its_peer(gpu_cluster, tmp_path):
    """Two ranks on two GPUs, their gradients summed by NCCL; rank 1 dies at the start of a step
    while rank 0 waits in the sum. The run ends where a calm run ends, and says whether the
    survivor's NCCL collective returned in time for a rebuild from it (else the checkpoint)."""

    def run(marks: str | None) -> tuple[list[float], flowrl.EngineStats]:
        policy = Policy("policy", {"num_replicas": 1, "batch_size": 4, "cpus_per_replica": 0.1})
        trainer = DiesInStep("trainer", gpu(1.0, num_replicas=2), marks=marks)
        checkpoints = {"dir": str(tmp_path / ("chaos" if marks else "calm")), "every": 1}
        engine, _ = sync_and_probe(policy, trainer, collective_timeout_s=60, checkpoint=checkpoints)
        weights = [step[r]["w_sum"] for ep in engine.train_results for step in ep["trainer"] for r in (0, 1)]
        return weights, engine.stats()

    calm, _ = run(None)
    chaos, stats = run(str(tmp_path))
    assert (tmp_path / "died").exists() and flowrl_actor_names() == []
    assert chaos == calm
    ((rebuilt,),) = [stats.rebuilds]
    assert (rebuilt.rank, rebuilt.source, rebuilt.redone) == (1, "survivor", 0), rebuilt


def test_nccl_weight_sync_on_one_gpu_is_refused_by_name(gpu_cluster):
    policy = Policy("policy", gpu(0.25, num_replicas=1, batch_size=4))
    trainer = Trainer("trainer", gpu(0.25, weight_transport="nccl"))
    with pytest.raises(flowrl.FlowError, match="NCCL takes one rank per GPU"):
        sync_and_probe(policy, trainer, colocation=[["policy", "trainer"]])
    assert flowrl_actor_names() == []


def test_six_ppo_models_colocated_on_one_gpu(gpu_cluster):
    names = ["policy", "reference", "reward", "value"]
    models = [Where(n, gpu(1.0, num_replicas=1, batch_size=8), src="x" if n == "policy" else "policy_y") for n in names]
    policy, reference, reward, value = models

    def rollout(x: Any) -> Any:
        out = policy.forward_step(x)
        return reward.forward_step(out, reference.forward_step(out), value.forward_step(out))

    class Count(flowrl.Model):
        def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
            return {"gpus": list(self.gpu_ids), "device": str(torch.zeros(1, device=self.device).device)}

        def get_weights(self) -> dict[str, Any]:
            return {}

    trainers = [Count(n, gpu(1.0)) for n in ("ppo_policy", "ppo_value")]
    engine = flowrl.Engine(
        rollout=rollout,
        train=trainers,
        config={
            "sample_per_episode": 16,
            "num_episode": 1,
            "progress": "off",
            "colocation": [names + ["ppo_policy", "ppo_value"]],
        },
    )
    engine.set_dataset([{"x": np.ones(4, dtype=np.float32)} for _ in range(16)])
    stats = engine.learn()
    samples = engine.relay_episodes[-1].buffer
    assert {s[f"{n}_gpus"] for s in samples for n in names} == {(0,)}  # six models, one GPU, 1/6 each
    assert all(s[f"{n}_device"].startswith("cuda") for s in samples for n in names)
    steps = [r for ep in engine.train_results for t in ep.values() for step in t for r in step]
    assert steps and all(r["gpus"] == [0] and r["device"].startswith("cuda") for r in steps)
    assert stats.rollout["policy.forward_step"].samples == 16 and flowrl_actor_names() == []
