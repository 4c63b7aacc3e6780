"""The RL engine on a real local Ray cluster: episodes, relay, trainer groups, sync, colocation."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import flowrl
from flowrl.testing import CountingTrainer, Scale, flowrl_actor_names

CPU = {"cpus_per_replica": 0.1}


def Where(*args, **kwargs) -> Scale:  # noqa: N802 - reads like the class it makes
    """A Scale that also reports the GPU ids its replica holds."""
    return Scale(*args, record_gpus=True, **kwargs)


def seed_models(gpu: float | None = None):
    g = {} if gpu is None else {"gpus_per_replica": gpu}
    wide = {"num_replicas": 8, "batch_size": 2, **CPU, **g}
    return (
        Where(
            "policy", {"num_replicas": 2, "batch_size": 4, **CPU, **g}, srcs=["query"], dst="policy_out", sleep_s=0.01
        ),
        Where("reference", wide, srcs=["policy_out"], dst="ref_out", factor=2, sleep_s=0.005),
        Where("reward", wide, srcs=["ref_out", "policy_out", "value_out"], dst="reward_out", sleep_s=0.005),
        Where("value", wide, srcs=["policy_out"], dst="value_out", factor=3, sleep_s=0.005),
        CountingTrainer("ppo_policy", {"num_replicas": 2, **CPU, **g}),
        CountingTrainer("ppo_value", {"num_replicas": 2, **CPU, **g}),
    )


@pytest.mark.slow  # ~47 s; tests/pipeline/test_seed_scenario.py runs the seed's layout by default
def test_seed_scenario_through_rlhf_engine_with_all_six_models_colocated(ray_cluster):
    models = seed_models(gpu=1.0)
    names = [m.name for m in models]
    config = {
        "sample_per_episode": 16,
        "num_episode": 2,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 4,
        "max_relay_episode": 1,
        "colocation": [names],
    }
    engine = flowrl.RLHFEngine(*models, config)
    relayed, used = [], []

    def relay(episodes):
        buffer = episodes[-1].buffer
        relayed.append((episodes[-1].episode_id, [s.id for s in buffer], [float(s["query"][0]) for s in buffer]))
        used.append({st: {s[f"{st}_replica"] for s in buffer} for st in ("reference", "value", "reward")})
        return buffer

    engine.set_relay_sample_fn(relay)
    engine.set_dataset([{"query": np.full(2, float(i))} for i in range(2048)])
    with engine:
        stats = engine.learn()
        assert len(flowrl_actor_names()) == 2 + 3 * 8 + 2 + 2
    assert flowrl_actor_names() == []
    for e, ids, queries in relayed:  # the relay function sees ids 16e .. 16e+15, in order
        assert ids == list(range(16 * e, 16 * e + 16)) and queries == [float(i) for i in ids]
    for stage in ("policy", "reference", "value", "reward"):
        assert stats.rollout[f"{stage}.forward_step"].samples == 32
    assert len(used) == 2
    for episode in used:  # every replica of every scorer worked in each episode
        assert all(replicas == set(range(8)) for replicas in episode.values()), episode
    samples = engine.relay_episodes[-1].buffer  # max_relay_episode=1: the last episode
    # all six models share the same 8 logical GPUs: replica r of each scorer sits on bundle r,
    # so the three scorers' replicas r hold one GPU together, and a model's 8 replicas hold 8
    gpus = {
        st: {s[f"{st}_replica"]: s[f"{st}_gpus"] for s in samples} for st in ("policy", "reference", "value", "reward")
    }
    for r in range(8):
        assert len(gpus["reference"][r]) == 1 and gpus["reference"][r] == gpus["value"][r] == gpus["reward"][r]
    assert len(set(gpus["reference"].values())) == 8
    assert all(gpus["policy"][r] == gpus["reference"][r] for r in gpus["policy"])
    assert stats.trainers["ppo_policy"].samples == 32 and stats.trainers["ppo_policy"].steps == 4


def test_colocation_puts_replicas_on_shared_gpus_and_without_it_they_are_disjoint(ray_cluster):
    def flow_models(colocate: bool):
        a = Where("a", {"num_replicas": 4, "gpus_per_replica": 1, "batch_size": 1, **CPU}, srcs=["x"], dst="ya")
        b = Where("b", {"num_replicas": 4, "gpus_per_replica": 1, "batch_size": 1, **CPU}, srcs=["x"], dst="yb")
        t = CountingTrainer("t", {"num_replicas": 1, **CPU})
        cfg = {"sample_per_episode": 8, "colocation": [["a", "b"]] if colocate else []}
        engine = flowrl.Engine(rollout=lambda x: (a.forward_step(x), b.forward_step(x)), train=[t], config=cfg)
        engine.set_dataset([{"x": np.zeros(1)} for _ in range(8)])
        return engine

    for colocate in (True, False):
        engine = flow_models(colocate)
        engine.learn()
        out = engine.relay_episodes[-1].buffer
        gpus_a = {s["a_replica"]: s["a_gpus"] for s in out}
        gpus_b = {s["b_replica"]: s["b_gpus"] for s in out}
        assert len(gpus_a) == len(gpus_b) == 4
        used_a = {g for gs in gpus_a.values() for g in gs}
        used_b = {g for gs in gpus_b.values() for g in gs}
        assert len(used_a) == len(used_b) == 4  # a model's replicas never share a GPU
        if colocate:
            assert used_a == used_b  # a and b live on the same 4 GPUs
        else:
            assert used_a.isdisjoint(used_b)  # 8 GPUs, each replica its own


def test_512_prompts_each_trained_once_over_two_ranks(ray_cluster):
    policy = Scale("policy", {"num_replicas": 4, "batch_size": 8, **CPU}, srcs=["x"], dst="y")
    scorer = Scale("scorer", {"num_replicas": 2, "batch_size": 16, **CPU}, srcs=["y"], dst="z")
    trainer = CountingTrainer("trainer", {"num_replicas": 2, **CPU})
    cfg = {"sample_per_episode": 256, "num_episode": 2, "train_global_batch_size": 16, "train_micro_batch_size": 4}
    engine = flowrl.Engine(rollout=lambda x: scorer.forward_step(policy.forward_step(x)), train=[trainer], config=cfg)
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(512)])
    engine.learn()
    seen = Counter()
    for results in engine.train_results:
        steps = results["trainer"]
        assert len(steps) == 16  # 256 / 16 steps per episode
        for step in steps:
            assert sorted(r["rank"] for r in step) == [0, 1] and all(r["world"] == 2 for r in step)
            assert all(m <= 4 for r in step for m in r["micro"]) and sum(len(r["ids"]) for r in step) == 16
            seen.update(i for r in step for i in r["ids"])
    assert sorted(seen) == list(range(512)) and set(seen.values()) == {1}


def train_batches(policy_replicas: int, batch_size: int) -> list:
    policy = Scale(
        "policy",
        {"num_replicas": policy_replicas, "batch_size": batch_size, **CPU},
        srcs=["x"],
        dst="y",
        jitter_seed=policy_replicas,
    )
    trainer = CountingTrainer("trainer", {"num_replicas": 1, **CPU})
    cfg = {"sample_per_episode": 16, "num_episode": 2, "train_global_batch_size": 6, "train_micro_batch_size": 4}
    engine = flowrl.Engine(rollout=lambda x: policy.forward_step(x), train=[trainer], config=cfg)
    engine.set_dataset([{"x": np.full(2, float(i))} for i in range(20)])
    captured = []

    def relay(episodes):
        captured.append([(s.id, tuple(np.asarray(s["y"]).tolist())) for s in episodes[-1].buffer])
        return episodes[-1].buffer

    engine.set_relay_sample_fn(relay)
    engine.learn()
    steps = [[r["ids"] for r in step] for ep in engine.train_results for step in ep["trainer"]]
    return [captured, steps]


def test_generation_batch_sizes_and_replica_counts_do_not_change_training_batches(ray_cluster):
    assert train_batches(4, 3) == train_batches(5, 2)


def test_relay_accumulates_dataset_wraps_and_groups_stay_together(ray_cluster):
    policy = Scale("policy", {"num_replicas": 2, "batch_size": 4, **CPU}, srcs=["x"], dst="y")
    trainer = CountingTrainer("trainer", {"num_replicas": 2, **CPU})
    cfg = {
        "sample_per_episode": 6,
        "num_episode": 3,
        "num_samples_per_prompt": 3,
        "max_relay_episode": 2,
        "train_global_batch_size": 6,
    }
    engine = flowrl.Engine(rollout=lambda x: policy.forward_step(x), train=[trainer], config=cfg)
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(3)])  # 2 prompts per episode, 3 in the dataset
    windows = []
    engine.set_relay_sample_fn(
        lambda eps: windows.append([e.episode_id for e in eps]) or [s for e in eps for s in e.buffer]
    )
    engine.learn()
    assert windows == [[0], [0, 1], [1, 2]]
    prompts = [s["prompt_index"] for ep in engine.relay_episodes for s in ep.buffer]
    assert prompts == [2, 2, 2, 0, 0, 0, 1, 1, 1, 2, 2, 2]  # wrap-around, copies consecutive
    for step in engine.train_results[-1]["trainer"]:  # a group never straddles two ranks
        owners = {}
        for r in step:
            for sid in r["ids"]:
                owners.setdefault(sid // 3, set()).add(r["rank"])
        assert all(len(v) == 1 for v in owners.values())


def test_weight_versions_increase_and_reach_every_policy_replica(ray_cluster):
    policy = Scale("policy", {"num_replicas": 3, "batch_size": 2, **CPU}, srcs=["x"], dst="y")
    trainer = CountingTrainer("trainer", {"num_replicas": 1, **CPU})
    cfg = {"sample_per_episode": 12, "num_episode": 3, "train_global_batch_size": 4}
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x), train=[trainer], sync=[(trainer, policy)], config=cfg
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(100)])
    versions = []
    engine.set_relay_sample_fn(
        lambda eps: (
            versions.append({(s["policy_replica"], s["policy_version"]) for s in eps[-1].buffer}) or eps[-1].buffer
        )
    )
    stats = engine.learn()
    for e, seen in enumerate(versions):  # episode e ran on weights of version e, on every replica
        assert {v for _, v in seen} == {e} and {r for r, _ in seen} == {0, 1, 2}
    assert [ep.weight_versions["policy"] for ep in stats.episodes] == [1, 2, 3]


def test_eval_flow_processes_every_eval_prompt_once(ray_cluster):
    policy = Scale("policy", {"num_replicas": 3, "batch_size": 2, **CPU}, srcs=["x"], dst="y", factor=2)
    trainer = CountingTrainer("trainer", {"num_replicas": 1, **CPU})
    cfg = {"sample_per_episode": 4, "num_episode": 2, "eval_every": 1}
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        config=cfg,
        eval_flow=lambda x: policy.forward_step(x),
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(4)])
    engine.set_eval_dataset([{"x": np.full(1, 100.0 + i)} for i in range(7)])
    stats = engine.learn()
    assert len(engine.eval_results) == 2
    for result in engine.eval_results:
        assert sorted(float(s["y"][0]) for s in result) == [2 * (100.0 + i) for i in range(7)]
    assert stats.evaluation["policy.forward_step"].samples == 14


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"train_global_batch_size": 6, "num_samples_per_prompt": 4, "sample_per_episode": 8}, "use e.g. 4 or 8"),
        ({"sample_per_episode": 10, "num_samples_per_prompt": 4, "train_global_batch_size": 4}, "e.g. 8 or 12"),
        ({"sample_per_episode": 8, "eval_every": 2}, "no eval_flow"),
        ({"sample_per_episode": 8, "models": {"nobody": {}}}, "unknown model"),
        ({"sample_per_episode": 8, "colocation": [["policy"], ["policy"]]}, "in groups 0 and 1"),
    ],
)
def test_bad_run_settings_are_rejected_when_the_engine_is_built(bad, message):
    policy = Scale("policy", {"num_replicas": 1}, srcs=["x"])
    trainer = CountingTrainer("trainer")
    with pytest.raises(flowrl.ConfigError, match=message):
        flowrl.Engine(rollout=lambda x: policy.forward_step(x), train=[trainer], config=bad)


def test_learn_twice_inside_with_continues_and_outside_it_runs_once(ray_cluster):
    policy = Scale("policy", {"num_replicas": 2, "batch_size": 2, **CPU}, srcs=["x"], dst="y")
    trainer = CountingTrainer("trainer", {"num_replicas": 1, **CPU})
    cfg = {"sample_per_episode": 4, "num_episode": 2, "max_relay_episode": -1}
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x), train=[trainer], sync=[(trainer, policy)], config=cfg
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(6)])
    with engine:
        engine.learn()
        stats = engine.learn()
    seen = [(s.id, float(s["x"][0]), s["policy_version"]) for ep in engine.relay_episodes for s in ep.buffer]
    assert [i for i, _, _ in seen] == list(range(16))  # ids continue
    assert [x for _, x, _ in seen] == [float(i % 6) for i in range(16)]  # the sampler continues, wrapping
    assert [v for _, _, v in seen] == [e for e in range(4) for _ in range(4)]  # weights carried over
    assert [e.episode for e in stats.episodes] == [0, 1, 2, 3]
    assert stats.trainers["trainer"].steps == 4
    with pytest.raises(flowrl.PipelineClosedError, match="with engine"):
        engine.learn()  # outside `with`, once only: its actors would start from scratch


def test_a_failing_trainer_rank_fails_the_run_instead_of_hanging_in_a_collective(ray_cluster):
    policy = Scale("policy", {"num_replicas": 1, "batch_size": 4, **CPU}, srcs=["x"], dst="y")
    trainer = CountingTrainer("trainer", {"num_replicas": 2, **CPU}, fail_rank=1)
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        config={"sample_per_episode": 8, "train_global_batch_size": 8},
    )
    engine.set_dataset([{"x": np.zeros(1)} for _ in range(8)])
    with pytest.raises(flowrl.StageError, match=r"'trainer\.train_step', replica 1.*rank 1 failed") as info:
        engine.learn()
    assert info.value.sample_ids == [4, 5, 6, 7]  # rank 1's shard of the global batch
    assert flowrl_actor_names() == []


def test_run_config_loads_yaml_and_toml_with_overrides(tmp_path):
    (tmp_path / "run.yaml").write_text(
        "sample_per_episode: 16\nnum_episode: 2\nmodels:\n  policy: {num_replicas: 2, batch_size: 4}\n"
    )
    (tmp_path / "run.toml").write_text(
        "sample_per_episode = 16\n[models.policy]\nnum_gpu = 8\ntensor_parallel_size = 4\n"
    )
    cfg = flowrl.RunConfig.load(tmp_path / "run.yaml", ["num_episode=5", "models.policy.batch_size=8", "shuffle=true"])
    assert (cfg.num_episode, cfg.shuffle, cfg.models["policy"].batch_size, cfg.models["policy"].replicas) == (
        5,
        True,
        8,
        2,
    )
    assert flowrl.RunConfig.load(tmp_path / "run.toml").models["policy"].replicas == 2
    with pytest.raises(flowrl.ConfigError, match="sample_per_eposide|unknown field"):
        flowrl.RunConfig.load(tmp_path / "run.yaml", ["sample_per_eposide=3"])
    with pytest.raises(flowrl.ConfigError, match="key=value"):
        flowrl.RunConfig.load(tmp_path / "run.yaml", ["num_episode"])
    with pytest.raises(flowrl.ConfigError, match="must be > 0"):
        flowrl.RunConfig.load(tmp_path / "run.yaml", ["num_episode=0"])


class LinearTrainer(flowrl.Model):
    """Least squares on y = 2x, one SGD step per global batch; reports its weight after each step."""

    def setup(self):
        import torch

        torch.manual_seed(0)
        self.module = torch.nn.Linear(1, 1, bias=False)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=0.1)

    def train_step(self, batch, iteration):
        import torch

        self.opt.zero_grad()
        for mb in self.micro_batches(batch):
            x = torch.as_tensor(np.asarray(mb["x"]), dtype=torch.float32)
            loss = ((self.module(x) - 2 * x) ** 2).sum() / self.global_batch_size
            loss.backward()
        self.all_reduce_grads(self.module)
        self.opt.step()
        return {"w": float(self.module.weight.item())}


@pytest.mark.parametrize("gbs, micro", [(5, 2), pytest.param(7, 3, marks=pytest.mark.slow)])  # 7-3: ~17 s more
def test_uneven_shards_give_the_same_weights_as_one_rank(ray_cluster, gbs, micro):
    def weights(ranks: int) -> list[float]:
        policy = Scale("policy", {"num_replicas": 2, "batch_size": 3, **CPU}, srcs=["x"], dst="y")
        trainer = LinearTrainer("trainer", {"num_replicas": ranks, **CPU})
        cfg = {
            "sample_per_episode": 12,
            "num_episode": 2,
            "train_global_batch_size": gbs,
            "train_micro_batch_size": micro,
        }
        engine = flowrl.Engine(rollout=lambda x: policy.forward_step(x), train=[trainer], config=cfg)
        engine.set_dataset([{"x": np.array([0.1 * (i + 1)])} for i in range(12)])
        engine.learn()
        return [step[0]["w"] for ep in engine.train_results for step in ep["trainer"]]

    one, three = weights(1), weights(3)  # 3 ranks: shards like 2,2,1 and some ranks empty
    assert len(one) == len(three) == 2 * -(-12 // gbs)
    assert np.allclose(one, three, atol=1e-6), (one, three)
    assert abs(one[-1] - 2.0) < abs(one[0] - 2.0)  # it learns


def test_cuda_ipc_weights_from_a_cpu_trainer_travel_by_host_and_checkpoints_between_syncs_are_refused(tmp_path):
    from _resume_models import make_engine

    ipc = {"learner": {"num_replicas": 1, "weight_transport": "cuda_ipc"}}
    engine, _ = make_engine(
        pipeline={"backend": "inprocess"},
        policy_replicas=1,
        ranks=1,
        models=ipc,
        sync_every=1,
        max_relay_episode=0,
        num_episode=3,
    )
    stats = engine.learn()  # its weights are CPU tensors: they go as numpy, as with "host"
    assert [e.weight_versions for e in stats.episodes] == [{"policy": 1}, {"policy": 2}, {"policy": 3}]
    assert all(e.staleness == {"policy": {0: 8}} for e in stats.episodes)
    for transport in ("cuda_ipc", "nccl"):
        with pytest.raises(
            flowrl.ConfigError, match=r"\['learner'\] send weights by CUDA IPC or NCCL, which a checkpoint"
        ):
            make_engine(
                models={"learner": {"weight_transport": transport}},
                sync_every=2,
                checkpoint={"every": 1, "dir": str(tmp_path)},
            )
    with pytest.raises(flowrl.ConfigError, match="weight_transport must be one of"):
        flowrl.ModelConfig(weight_transport="rdma")
