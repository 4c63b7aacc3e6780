"""Every setting is checked when its Struct is built: NaN and infinities in any float field
(found by introspection, so a new field is covered without a new test), negative seeds, a
flow of the wrong arity."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from flowrl._core import config as core_config
from flowrl._core import run_config
from flowrl._core import simulate as sim
from flowrl._core.config import _holds_float, to_config
from flowrl._core.errors import ConfigError, FlowDefinitionError
from flowrl._core.graph import trace
from flowrl._core.run_config import RunConfig
from flowrl.hf import config as hf_config

MODULES = (core_config, run_config, hf_config, sim)
# The least each config Struct needs besides its defaults.
REQUIRED: dict[str, dict[str, Any]] = {
    "Autoscale": {"max_replicas": 1},
    "RunConfig": {"sample_per_episode": 1},
    "LM": {"path": "some/folder"},
    "SimStage": {"name": "a", "replicas": 1, "batch_size": 1},
    "Workload": {"stages": [sim.SimStage(name="a", replicas=1, batch_size=1)], "samples": 1},
}


def _config_structs() -> list[type[msgspec.Struct]]:
    # settings, as opposed to control messages: the Structs that refuse unknown fields (by
    # identity: flowrl re-exports the public ones under its own __module__)
    found = {
        cls
        for module in MODULES
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and cls.__struct_config__.forbid_unknown_fields
    }
    return sorted(found, key=lambda c: c.__name__)


def _float_fields() -> list[tuple[type[msgspec.Struct], msgspec.structs.FieldInfo]]:
    return [(cls, f) for cls in _config_structs() for f in msgspec.structs.fields(cls) if _holds_float(f.type)]


FLOAT_FIELDS = _float_fields()
BAD = [math.nan, math.inf, -math.inf]


def _bad_value(field: msgspec.structs.FieldInfo, bad: float) -> Any:
    # a sequence of floats (Optim.betas) gets the bad number as its first item
    return (bad, *field.default[1:]) if isinstance(field.default, tuple) else bad


def test_the_introspection_finds_the_config_structs_and_their_float_fields():
    names = {c.__name__ for c in _config_structs()}
    assert {
        "Autoscale",
        "ModelConfig",
        "PipelineConfig",
        "RunConfig",
        "LM",
        "Sampling",
        "Optim",
        "GRPO",
        "PPO",
    } <= names
    fields = {f"{c.__name__}.{f.name}" for c, f in FLOAT_FIELDS}
    assert {"ModelConfig.call_timeout_s", "ModelConfig.cpus_per_replica", "Autoscale.every_s", "Optim.betas"} <= fields
    assert {"RunConfig.collective_timeout_s", "PipelineConfig.setup_timeout_s", "Sampling.temperature"} <= fields
    assert {"StageCost.call_s", "Workload.overhead_s", "Workload.cost_hint_sigma"} <= fields  # the simulator's


@pytest.mark.parametrize("cls", _config_structs(), ids=lambda c: c.__name__)
def test_each_config_struct_builds_from_its_required_fields(cls):
    cls(**REQUIRED.get(cls.__name__, {}))  # the other tests start from this


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(("cls", "field"), FLOAT_FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in FLOAT_FIELDS])
def test_a_non_finite_float_setting_is_refused_naming_the_field(cls, field, bad):
    values = {**REQUIRED.get(cls.__name__, {}), field.name: _bad_value(field, bad)}
    message = rf"{cls.__name__}\.{field.name} must be a finite number, got {bad!r}"
    with pytest.raises(ConfigError, match=message):
        cls(**values)  # built in code
    with pytest.raises(ConfigError, match=message):
        to_config(cls, values, "a run file")  # read from a mapping (a run file)


def test_a_nan_in_a_nested_model_config_is_refused_from_a_run_config_mapping():
    data = {"sample_per_episode": 1, "models": {"policy": {"autoscale": {"max_replicas": 2, "every_s": math.nan}}}}
    with pytest.raises(ConfigError, match=r"Autoscale\.every_s must be a finite number, got nan"):
        RunConfig.from_mapping(data)


@pytest.mark.parametrize("override", ["models.policy.call_timeout_s=.nan", "collective_timeout_s=.inf"])
def test_a_non_finite_override_is_refused(override):
    # refused by the override's own parsing, and by the Struct whatever the reading
    with pytest.raises(ConfigError, match=r"finite number"):
        RunConfig.from_mapping({"sample_per_episode": 1}, [override])


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("seed", [-1, -(2**40)])
def test_a_negative_seed_is_refused_when_the_run_config_is_built(seed, shuffle):
    with pytest.raises(ConfigError, match=rf"RunConfig\.seed must be >= 0, got {seed}"):
        RunConfig(sample_per_episode=1, seed=seed, shuffle=shuffle)


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**64])
def test_an_lm_seed_outside_torchs_range_is_refused(seed):
    with pytest.raises(ConfigError, match=r"LM\.seed must be in \[-2\*\*63, 2\*\*64\)"):
        hf_config.LM(path="some/folder", seed=seed)


def _two(a, b):
    return a


def _none():
    return None


class _Callable:
    def __call__(self, x, y, *, z):
        return x


@pytest.mark.parametrize(
    ("flow", "shown"),
    [
        (_two, r"_two\(a, b\)"),
        (_none, r"_none\(\)"),
        (lambda: None, r"<lambda>\(\)"),
        (_Callable(), r"\(x, y, \*, z\)"),
    ],
    ids=["two-arguments", "none", "lambda", "callable-object"],
)
def test_a_flow_of_the_wrong_arity_is_named_when_traced(flow, shown):
    with pytest.raises(FlowDefinitionError, match=rf"flow .*{shown} cannot be called with one argument"):
        trace(flow)


def test_a_flow_with_defaults_or_varargs_still_traces_and_builtins_fall_back_to_the_call():
    # extra parameters with defaults, *args: callable with one argument, so not refused here
    with pytest.raises(FlowDefinitionError, match=r"calls no model step"):
        trace(lambda x, y=1, *rest: x)
    with pytest.raises(FlowDefinitionError, match=r"must return the output of a stage"):
        trace(print)  # no signature problem: the flow runs and returns None


def test_a_models_step_given_as_the_flow_is_not_refused_for_its_replica_signature():
    from flowrl.testing import Scale

    policy = Scale("policy", {}, srcs=["x"], dst="y")  # forward_step(self, batch, iteration)
    assert list(trace(policy.forward_step).stages) == ["policy.forward_step"]
