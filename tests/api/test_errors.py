"""User mistakes get a clear error naming what was expected, what was given and where
(the table in docs/errors.md). In-process where the mistake does not need Ray."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl.testing import CountingTrainer, Scale

LOCAL = {"backend": "inprocess"}


def _engine(relay=None, **run: Any) -> flowrl.Engine:
    policy = Scale("policy", {"num_replicas": 1, "batch_size": 2}, srcs=["x"], dst="y")
    trainer = CountingTrainer("trainer")
    cfg = {"sample_per_episode": 4, "num_episode": 1, "train_global_batch_size": 4, "pipeline": LOCAL, **run}
    engine = flowrl.Engine(rollout=lambda x: policy.forward_step(x), train=[trainer], config=cfg)
    if relay is not None:
        engine.set_relay_sample_fn(relay)
    return engine


@pytest.mark.parametrize(
    ("relay", "message"),
    [
        (lambda episodes: None, r"relay function <lambda> returned NoneType; it must return the samples to train on"),
        (lambda episodes: [], r"relay function <lambda> returned no samples"),
        (lambda episodes: [dict(s) for s in episodes[-1].buffer], r"returned a dict among its samples"),
        (lambda episodes: episodes[-1].buffer[0], r"returned Sample; it must return the samples"),
    ],
    ids=["none", "empty", "dicts", "one-sample"],
)
def test_a_relay_function_that_returns_no_samples_is_named(relay, message):
    engine = _engine(relay)
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(8)])
    with pytest.raises(flowrl.FlowDefinitionError, match=message):
        engine.learn()


def test_dataset_items_must_be_mappings_and_the_dataset_not_empty():
    engine = _engine()
    with pytest.raises(flowrl.ConfigError, match=r"dataset item 1 is a list; items must be mappings"):
        engine.set_dataset([{"x": [0.0]}, [1.0]])
    with pytest.raises(
        flowrl.ConfigError, match=r"the dataset is empty; engine.set_dataset\(items\) needs at least one item"
    ):
        engine.set_dataset([])


def test_learn_before_set_dataset_says_what_to_call():
    with pytest.raises(flowrl.ConfigError, match=r"call engine.set_dataset\(items\) before learn\(\)"):
        _engine().learn()


def test_a_flow_calling_a_step_its_model_lacks_names_the_model_and_the_step():
    policy = Scale("policy", {}, srcs=["x"], dst="y")
    with pytest.raises(
        flowrl.FlowDefinitionError, match=r"calls policy.eval_step, but Scale does not define eval_step"
    ):
        flowrl.run_flow(lambda x: policy.eval_step(x), [{"x": [1.0]}], LOCAL)
    assert not hasattr(policy, "eval_step") and not hasattr(policy, "buffer")  # hasattr still answers


def test_unknown_colocation_model_and_unknown_pipeline_key_are_named():
    with pytest.raises(flowrl.ConfigError, match=r"RunConfig.colocation names unknown model\(s\) \['critic'\]"):
        _engine(colocation=[["policy", "critic"]])
    with pytest.raises(flowrl.ConfigError, match=r"pipeline config: Object contains unknown field `max_inflights`"):
        flowrl.run_flow(lambda x: x, [{"x": 1}], {"max_inflights": 3})


class Drifting(flowrl.Model):
    """Its first shard adds ``a``, later ones ``b``."""

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        first = not hasattr(self, "seen")
        self.seen = True
        return {"a" if first else "b": [0] * len(batch)}


class Versioned(flowrl.Model):
    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"policy_version": [0] * len(batch)}

    def set_weights(self, weights: Any) -> None:  # synced: a model without self.module loads its own way
        pass


def test_shards_of_one_stage_returning_different_fields_are_an_output_error():
    model = Drifting("d", {"batch_size": 2})
    with pytest.raises(flowrl.OutputError, match=r"returned fields \['b'\], but its earlier shards returned \['a'\]"):
        flowrl.run_flow(lambda x: model.forward_step(x), [{"x": i} for i in range(6)], LOCAL)


def test_a_step_may_not_write_the_weight_version_field_of_its_model():
    policy = Versioned("policy", {"batch_size": 2})
    trainer = CountingTrainer("trainer")
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={"sample_per_episode": 4, "train_global_batch_size": 4, "pipeline": LOCAL},
    )
    engine.set_dataset([{"x": float(i)} for i in range(4)])
    with pytest.raises(flowrl.OutputError, match=r"field 'policy_version' is reserved for the weight version"):
        engine.learn()


class BadTrainer(CountingTrainer):
    def train_step(self, batch: flowrl.Batch, iteration: int) -> Any:
        return 0.5  # a loss, not a mapping of metrics


def test_train_step_returning_a_number_is_an_output_error():
    policy = Scale("policy", {"batch_size": 2}, srcs=["x"], dst="y")
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[BadTrainer("trainer")],
        config={"sample_per_episode": 4, "train_global_batch_size": 4, "pipeline": LOCAL},
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(4)])
    with pytest.raises(flowrl.OutputError, match=r"train_step must return a mapping of metrics or None, got float"):
        engine.learn()


@pytest.mark.parametrize(
    "key",
    [
        "sample_per_episode",
        "num_episode",
        "train_global_batch_size",
        "train_micro_batch_size",
        "num_training_epoch",
        "sync_every",
        "num_samples_per_prompt",
        "collective_timeout_s",
    ],
)
def test_run_config_sizes_must_be_positive(key):
    cfg = {"sample_per_episode": 4, key: 0}
    with pytest.raises(flowrl.ConfigError, match=rf"RunConfig.{key} must be > 0, got 0"):
        flowrl.RunConfig.from_mapping(cfg)


def test_input_items_must_be_mappings_with_the_same_fields():
    model = Scale("m", {"batch_size": 2}, srcs=["x"])
    with pytest.raises(flowrl.FlowDefinitionError, match=r"input item 1 is a list; items must be mappings"):
        flowrl.run_flow(lambda x: model.forward_step(x), [{"x": [1.0]}, [2.0]], LOCAL)
    items = [{"x": [float(i)]} for i in range(4)] + [{"x": [4.0], "y": 1}]
    with pytest.raises(
        flowrl.FlowDefinitionError, match=r"input items have fields \['x', 'y'\], earlier items had \['x'\]"
    ):
        flowrl.run_flow(lambda x: model.forward_step(x), items, {**LOCAL, "input_chunk": 4})


def test_every_test_named_in_the_errors_page_exists():
    import re
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    page = (tests.parent / "docs" / "errors.md").read_text()
    named = re.findall(r"`(\w+/test_\w+\.py)::(test_\w+)`", page)
    assert len(named) >= 30
    missing = [f"{f}::{t}" for f, t in named if not (tests / f).is_file() or f"def {t}(" not in (tests / f).read_text()]
    assert missing == []
    assert "`test_" not in page  # every test is named with its folder


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: flowrl.ModelConfig(batch_size=2.5), r"ModelConfig.batch_size=2.5: Expected `int`, got `float`"),
        (lambda: flowrl.ModelConfig(prefetch=True), r"ModelConfig.prefetch=True: Expected `int`, got `bool`"),
        (lambda: flowrl.PipelineConfig(ordered="no"), r"PipelineConfig.ordered='no': Expected `bool`, got `str`"),
        (lambda: flowrl.RunConfig(sample_per_episode=8, shuffle="yes"), r"RunConfig.shuffle='yes': Expected `bool`"),
    ],
    ids=["float-size", "bool-size", "str-flag", "run-flag"],
)
def test_a_config_built_directly_is_type_checked_too(build, message):
    with pytest.raises(flowrl.ConfigError, match=message):
        build()


def test_numpy_numbers_in_a_config_are_numbers():
    assert flowrl.ModelConfig(num_replicas=np.int64(4), cpus_per_replica=np.float32(0.5)).replicas == 4


def test_samples_of_one_input_chunk_with_different_fields_name_the_samples():
    model = Scale("m", {"batch_size": 2}, srcs=["x"])
    items = [{"x": [0.0]}, {"x": [1.0]}, {"x": [2.0], "extra": 1}]
    with pytest.raises(flowrl.FlowDefinitionError, match=r"sample 2 has fields \['extra', 'x'\], sample 0 has \['x'\]"):
        flowrl.run_flow(lambda x: model.forward_step(x), items, LOCAL)


def test_dataset_items_may_not_carry_the_group_fields_the_engine_adds():
    engine = _engine(num_samples_per_prompt=2)
    with pytest.raises(flowrl.ConfigError, match=r"must not have fields \['prompt_index', 'copy_index'\]"):
        engine.set_dataset([{"x": [0.0]}, {"x": [1.0], "copy_index": 3}])  # not only the first item is checked


def _spec(gpus: float, cpus: float = 0.5, bundle: tuple[float, float] | None = None, group: str = "g"):
    from flowrl._backends.specs import Bundle, ReplicaSpec

    placed = None if bundle is None else Bundle(group=group, index=0, size=1, cpus=bundle[0], gpus=bundle[1])
    return ReplicaSpec(Scale("m", {}, srcs=["x"]), 0, cpus, gpus, placed)


TWO_NODES = [{"CPU": 2.0, "GPU": 2.0}, {"CPU": 2.0, "GPU": 2.0}]


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([_spec(1), _spec(1)], None),  # fits
        (
            [_spec(2), _spec(2), _spec(1)],
            r"the pools need 5 GPU \(m: 5\) but the cluster has 4; lower ModelConfig.gpus_per_replica",
        ),
        ([_spec(3)], r"model 'm' needs 0.5 CPU and 3 GPU on one node, but the largest node has 2 CPU and 2 GPU"),
        ([_spec(1, bundle=(1.0, 3.0))], r"needs a placement bundle of 1 CPU and 3 GPU on one node"),
        # a placement group is reserved whole: three of 2 GPUs do not fit 4, whatever their replicas' shares
        (
            [_spec(0.25, bundle=(1.0, 2.0), group=g) for g in ("a", "b", "c")],
            r"the pools need 6 GPU \(placement group a of m: 2, placement group b of m: 2, placement group c of m: 2\) "
            r"but the cluster has 4",
        ),
        ([_spec(0.5, bundle=(1.0, 2.0)), _spec(0.5, bundle=(1.0, 2.0)), _spec(2)], None),  # one group, reserved once
    ],
    ids=["fits", "total", "one-node", "bundle", "placement-groups", "one-group"],
)
def test_replicas_that_cannot_fit_the_cluster_or_one_node_are_refused_before_any_starts(specs, message):
    from flowrl._backends.specs import check_capacity

    total = {"CPU": 4.0, "GPU": 4.0}
    if message is None:
        check_capacity(specs, total, TWO_NODES)
    else:
        with pytest.raises(flowrl.ClusterError, match=message):
            check_capacity(specs, total, TWO_NODES)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_negative_seed_is_refused_when_the_engine_is_built_not_at_the_first_episode(shuffle):
    with pytest.raises(flowrl.ConfigError, match=r"RunConfig.seed must be >= 0, got -3"):
        _engine(seed=-3, shuffle=shuffle)


def _two_inputs(prompts, rewards):
    return prompts


@pytest.mark.parametrize("role", ["rollout", "eval_flow", "train"])
def test_a_flow_of_the_wrong_arity_is_named_when_the_engine_is_built(role):
    policy = Scale("policy", {"batch_size": 2}, srcs=["x"], dst="y")
    trainer = CountingTrainer("trainer")
    flows: dict[str, Any] = {"rollout": lambda x: policy.forward_step(x), "train": [trainer], role: _two_inputs}
    with pytest.raises(
        flowrl.FlowDefinitionError,
        match=r"flow _two_inputs\(prompts, rewards\) cannot be called with one argument \(the flow input.*"
        r"missing a required argument: 'rewards'",
    ):
        flowrl.Engine(config={"sample_per_episode": 4, "pipeline": LOCAL}, **flows)


def test_a_relay_function_of_the_wrong_arity_is_named_when_it_is_given():
    engine = _engine()
    with pytest.raises(
        flowrl.FlowDefinitionError,
        match=r"relay function _two_inputs\(prompts, rewards\) cannot be called with one argument \(the list of "
        r"episodes the relay buffer holds\): missing a required argument: 'rewards'",
    ):
        engine.set_relay_sample_fn(_two_inputs)


def test_autoscale_on_a_trainer_is_refused_when_the_engine_is_built():
    policy = Scale("policy", {"batch_size": 2}, srcs=["x"], dst="y")
    trainer = CountingTrainer("trainer", {"autoscale": {"max_replicas": 2}})
    with pytest.raises(
        flowrl.ConfigError, match=r"trainer 'trainer' has ModelConfig.autoscale, but a trainer is a data-parallel group"
    ):
        flowrl.Engine(
            rollout=lambda x: policy.forward_step(x),
            train=[trainer],
            config={"sample_per_episode": 4, "pipeline": LOCAL},
        )


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: flowrl.ModelConfig(batchsize=2),
            r"ModelConfig: Unexpected keyword argument 'batchsize'; its keys are ",
        ),
        (lambda: flowrl.RunConfig(), r"RunConfig: Missing required argument 'sample_per_episode'"),
        (lambda: flowrl.PipelineConfig(4), r"PipelineConfig: Extra positional arguments provided"),
        (lambda: flowrl.Autoscale(max_replica=2), r"Autoscale: Unexpected keyword argument 'max_replica'"),
    ],
    ids=["unknown", "missing", "positional", "nested-struct"],
)
def test_a_config_built_with_a_wrong_keyword_is_a_config_error_listing_its_keys(build, message):
    with pytest.raises(flowrl.ConfigError, match=message) as caught:
        build()
    assert isinstance(caught.value.__cause__, TypeError)  # msgspec's own, chained
