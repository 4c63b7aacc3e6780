"""Data-parallel trainers: gradients summed over the ranks by flowrl (never twice), the check
that the ranks hold the same weights after the first step, and the checks before episode 0
(a synced model without ``self.module``, the ``auto_reduce_grads`` switch)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import _rank_trainers as rt
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import flowrl
from flowrl._core.errors import RankDivergenceError
from flowrl._engine.training import check_same_weights
from flowrl.testing import flowrl_actor_names

if TYPE_CHECKING:
    from pathlib import Path

CPU = {"cpus_per_replica": 0.1}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[list[dict[str, Any]]]]:
    """Each case of ``_rank_trainers.TRAINERS`` trained by two spawned ranks of a real gloo group
    (one spawn for all the cases): per case, per rank, each step's result."""
    folder = tmp_path_factory.mktemp("ranks")
    mp.start_processes(rt.rank_main, args=(2, str(folder)), nprocs=2, join=True, start_method="spawn")
    per_rank = [torch.load(folder / f"rank{r}.pt") for r in range(2)]
    return {name: [per_rank[0][name], per_rank[1][name]] for name in rt.TRAINERS}


@pytest.mark.parametrize("name", ["auto", "manual", "held"])
def test_two_ranks_take_the_steps_of_one_rank_whoever_sums_the_gradients(two_ranks, name):
    # "auto": no all_reduce_grads, flowrl sums before optimizer.step(); "manual": all_reduce_grads
    # and two optimizers; "held": the optimizer in a plain helper object (self.state.opt).
    # Unsummed gradients would give each rank half the step, summed twice
    # twice the step: either way not the one-rank weights.
    one = [step["weights"] for step in rt.train(name, 0, 1, None, micro_batch=4)]
    for rank in range(2):
        assert np.allclose([s["weights"] for s in two_ranks[name][rank]], one, atol=1e-6), (name, rank)
    assert not np.allclose(one[0], one[-1])  # it learns


def test_an_optimizer_stepped_per_micro_batch_has_each_steps_gradients_summed(two_ranks):
    torch.manual_seed(0)
    module = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(module.parameters(), lr=0.2)
    rows = np.stack([r["x"] for r in rt.dataset()])
    expected = []
    for _ in range(rt.STEPS):
        for k in range(2):  # micro-batch k of each rank: rows 2k, 2k+1 of rank 0, 4+2k, 5+2k of rank 1
            x = torch.as_tensor(rows[[2 * k, 2 * k + 1, 4 + 2 * k, 5 + 2 * k]])
            opt.zero_grad()
            (((module(x).squeeze(1) - (x[:, 0] - x[:, 1])) ** 2).sum() / 4).backward()
            opt.step()
        expected.append(torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist())
    for rank in range(2):
        assert np.allclose([s["weights"] for s in two_ranks["per-micro-batch"][rank]], expected, atol=1e-6)


def test_a_ddp_module_is_left_to_ddp(two_ranks):
    # DDP averages over the 2 ranks a gradient normalised by the global batch: half the one-rank
    # gradient, as one rank at half the learning rate; summed again by flowrl it would be the full one
    runtime = rt.TrainerRuntime(rt.AutoTrainer("half", {}), 0, 1)
    runtime.setup(None, [], "local", 60.0)
    runtime.model.optimizer.param_groups[0]["lr"] = 0.1
    half = [runtime.train(rt.shard(0, 1), rt.SAMPLES, 8, step)["weights"] for step in range(rt.STEPS)]
    for rank in range(2):
        assert np.allclose([s["weights"] for s in two_ranks["ddp"][rank]], half, atol=1e-6), rank


def test_ranks_report_checksums_after_their_first_step_only(two_ranks):
    first, later = two_ranks["auto"][0][0], two_ranks["auto"][0][1]
    assert first["_weights_before"][0] == first["_weights_after"][0] == 3  # Linear(2, 1): 3 weights
    assert first["_weights_before"] != first["_weights_after"]
    assert "_weights_before" not in later and "_weights_after" not in later
    check_same_weights("auto", [dict(r[0]) for r in two_ranks["auto"]], 0)  # identical: no error


def test_a_module_held_in_a_plain_object_is_fingerprinted(two_ranks):
    before, after = (two_ranks["held"][r][0] for r in range(2))
    assert before["_weights_before"][0] == before["_weights_after"][0] == 3  # self.state.net: Linear(2, 1)
    assert before["_weights_before"] != before["_weights_after"]
    check_same_weights("held", [dict(before), dict(after)], 0)


class AdamLayer(flowrl.Model):
    """A 1024x1024 layer trained by Adam at an LLM's learning rate, each rank on data of its own,
    with no gradient sum: every weight moves by about 1e-6, differently on each rank."""

    auto_reduce_grads = False

    def setup(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(1024, 1024)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=1e-6)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(100 + self.rank))
        self.optimizer.zero_grad()
        (self.module(x) ** 2).sum().backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        return {}


def _first_step(model: flowrl.Model, rank: int) -> dict[str, Any]:
    """Rank ``rank`` of 2 takes its first step in this process (no group: nothing is summed)."""
    runtime = rt.TrainerRuntime(model, rank, 2)
    model.setup()
    return runtime.train(rt.shard(rank, 2), rt.SAMPLES, 4, 0)


def test_a_step_at_learning_rate_1e_6_without_a_gradient_sum_is_caught():
    results = [_first_step(AdamLayer("adam"), rank) for rank in range(2)]
    assert results[0]["_weights_before"] == results[1]["_weights_before"]
    with pytest.raises(RankDivergenceError, match=r"trainer 'adam': ranks \[0, 1\] hold different weights after"):
        check_same_weights("adam", results, 0)


class Idle(flowrl.Model):
    """Holds a module but no optimizer, and never sums a gradient."""

    def setup(self) -> None:
        self.module = torch.nn.Linear(2, 1)

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {}


class Empty(Idle):
    """Holds no trainable parameter at all."""

    def setup(self) -> None:
        self.module = torch.nn.Linear(2, 1).requires_grad_(False)


def test_several_ranks_with_no_optimizer_to_hook_are_told_once(caplog: pytest.LogCaptureFixture):
    with caplog.at_level("WARNING", logger="flowrl"):
        _first_step(Idle("idle"), 0)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].startswith("trainer 'idle' (Idle) on 2 ranks: auto_reduce_grads is on but after the first")
    assert "holds no torch optimizer" in said[0] and "self.all_reduce_grads(module)" in said[0]


def test_several_ranks_with_no_trainable_parameters_are_told_nothing_is_compared(caplog: pytest.LogCaptureFixture):
    with caplog.at_level("WARNING", logger="flowrl"):
        result = _first_step(Empty("empty"), 0)
    assert result["_weights_before"] is None and result["_weights_after"] is None
    assert any("found no trainable parameters" in r.getMessage() for r in caplog.records)


@pytest.mark.timeout(120)
def test_a_grad_scaler_under_the_automatic_sum_is_refused_at_setup_on_every_rank(tmp_path: Path):
    # a real gloo group: were it let through, a rank whose scaler found inf would skip the sum
    mp.start_processes(rt.amp_main, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    for rank in range(2):
        said = (tmp_path / f"rank{rank}.txt").read_text()
        assert said.startswith(f"StageError: stage 'amp.setup', replica {rank}, samples []: ConfigError: "), said
        assert "trainer 'amp' (AmpTrainer) runs on 2 ranks with auto_reduce_grads = True" in said
        assert "holds a GradScaler (self.scaler), optimizers self.optimizer" in said
        assert "Set auto_reduce_grads = False" in said and "after scaler.scale(loss).backward()" in said


@pytest.mark.parametrize(
    "name, when, why",
    [
        ("unreduced", "after", "gradients were not summed over the ranks"),
        ("unseeded", "before", "started from different weights"),
    ],
)
def test_ranks_that_diverge_are_named_with_their_checksums(two_ranks, name, when, why):
    results = [dict(r[0]) for r in two_ranks[name]]
    with pytest.raises(
        RankDivergenceError, match=rf"trainer '{name}': ranks \[0, 1\] hold different weights {when}"
    ) as info:
        check_same_weights(name, results, 3)
    err = info.value
    assert why in str(err) and "(episode 3)" in str(err) and "rank 1: 3 weights, sum" in str(err)
    assert (err.trainer, err.ranks) == (name, [0, 1]) and err.values[0] != err.values[1]
    assert isinstance(err, flowrl.FlowError)


class Policy(flowrl.Model):
    """Inference copy of ``AutoTrainer``'s module: its prediction, as the field ``y``."""

    def setup(self) -> None:
        torch.manual_seed(0)
        self.module = torch.nn.Linear(2, 1)

    @torch.no_grad()
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"y": self.module(rt.x_of(batch)).squeeze(1)}


def _engine(trainer: flowrl.Model, policy: flowrl.Model, **config: Any) -> flowrl.Engine:
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={"sample_per_episode": rt.SAMPLES, "num_episode": 2, "train_global_batch_size": rt.SAMPLES, **config},
    )
    engine.set_dataset(rt.dataset())
    return engine


def test_on_ray_ranks_without_a_gradient_sum_fail_after_the_first_episode(ray_cluster):
    policy = Policy("policy", {"num_replicas": 1, "batch_size": 4, **CPU})
    engine = _engine(rt.UnreducedTrainer("learner", {"num_replicas": 2, **CPU}), policy)
    with pytest.raises(
        RankDivergenceError,
        match=r"trainer 'learner': ranks \[0, 1\] hold different weights after their first train step \(episode 0\)",
    ):
        engine.learn()
    assert engine.train_results == [] and flowrl_actor_names() == []


def test_on_ray_ranks_whose_gradients_flowrl_sums_train_as_one_rank(ray_cluster):
    policy = Policy("policy", {"num_replicas": 1, "batch_size": 4, **CPU})
    engine = _engine(rt.AutoTrainer("learner", {"num_replicas": 2, **CPU}), policy)
    stats = engine.learn()
    assert [e.weight_versions for e in stats.episodes] == [{"policy": 1}, {"policy": 2}]
    one = [step["weights"] for step in rt.train("auto", 0, 1, None, micro_batch=8)]
    got = [[rank["weights"] for rank in step] for ep in engine.train_results for step in ep["learner"]]
    assert np.allclose(got, [[w, w] for w in one[:2]], atol=1e-6)  # one step per episode, both ranks alike
    assert flowrl_actor_names() == []


# ---- checks before episode 0 (in process) ----


class NoModule(flowrl.Model):
    """A model that keeps its weights under another name and overrides no weight hook."""

    def setup(self) -> None:
        self.net = torch.nn.Linear(2, 1)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"y": [0.0] * len(batch)}

    def train_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        raise AssertionError("the engine must fail before any train step")


class OwnSetWeights(NoModule):
    def set_weights(self, weights: Any) -> None:
        self.net.load_state_dict(weights)


INPROCESS = {"pipeline": {"backend": "inprocess"}}


@pytest.mark.parametrize("side", ["target", "trainer"])
def test_a_synced_model_without_a_module_fails_at_setup_before_episode_zero(side):
    trainer = NoModule("learner") if side == "trainer" else rt.AutoTrainer("learner")
    policy = NoModule("policy", {"batch_size": 4}) if side == "target" else Policy("policy", {"batch_size": 4})
    engine = _engine(trainer, policy, **INPROCESS)
    bad, hook, verb = (
        ("policy", "set_weights", "receives weights from \\['learner'\\]")
        if side == "target"
        else ("learner", "get_weights", "sends weights to \\['policy'\\]")
    )
    with pytest.raises(
        flowrl.StageError,
        match=rf"'{bad}\.setup'.*model '{bad}' {verb} \(Engine\(sync=\.\.\.\)\), but after setup\(\) it has "
        rf"no self\.module; set self\.module .* or override {hook}\(\) in NoModule",
    ):
        engine.learn()
    assert engine.train_results == [] and engine.relay_episodes == []


def test_on_ray_trainer_ranks_without_a_module_fail_at_setup(ray_cluster):
    policy = Policy("policy", {"num_replicas": 1, "batch_size": 4, **CPU})
    engine = _engine(NoModule("learner", {"num_replicas": 2, **CPU}), policy)
    with pytest.raises(
        flowrl.StageError, match=r"'learner\.setup'.*model 'learner' sends weights to \['policy'\]"
    ) as info:
        engine.learn()
    assert "override get_weights() in NoModule" in str(info.value) and engine.relay_episodes == []
    assert flowrl_actor_names() == []


def test_a_model_that_loads_weights_its_own_way_needs_no_module():
    def learn(target: flowrl.Model) -> Any:
        return _engine(rt.AutoTrainer("learner"), target, num_episode=1, **INPROCESS).learn()

    assert [e.weight_versions for e in learn(OwnSetWeights("policy", {"batch_size": 4})).episodes] == [{"policy": 1}]
    # the same model outside a sync pair is not checked: only what the engine syncs needs the hooks
    engine = flowrl.Engine(
        rollout=lambda x: NoModule("scorer", {"batch_size": 4}).forward_step(x),
        train=[rt.AutoTrainer("learner")],
        config={"sample_per_episode": rt.SAMPLES, "num_episode": 1, **INPROCESS},
    )
    engine.set_dataset(rt.dataset())
    assert len(engine.learn().episodes) == 1


def test_auto_reduce_grads_must_be_a_bool_and_is_checked_when_the_engine_is_built():
    class Maybe(rt.AutoTrainer):
        auto_reduce_grads = "yes"  # type: ignore[assignment]

    with pytest.raises(
        flowrl.ConfigError, match=r"trainer 'learner': Maybe\.auto_reduce_grads must be True .* or False .*, got 'yes'"
    ):
        _engine(Maybe("learner"), Policy("policy"), **INPROCESS)


def test_an_unpicklable_attribute_is_named_in_process_too(tmp_path: Path):
    import threading

    class Locked(Policy):
        def __init__(self, name: str, config: Any = None) -> None:
            super().__init__(name, config)
            self.lock = threading.Lock()

    engine = _engine(rt.AutoTrainer("learner"), Locked("policy", {"batch_size": 4}), **INPROCESS)
    with pytest.raises(
        flowrl.ConfigError,
        match=r"model 'policy' \(Locked\) cannot be copied to its replicas: its attribute 'lock' \(lock\) cannot be "
        r"copied \(TypeError: .*\); build it in setup\(\)",
    ):
        engine.learn()
