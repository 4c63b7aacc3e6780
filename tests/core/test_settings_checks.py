"""Every setting is checked when its Struct is built: NaN and infinities in any float field and
ints beyond the runtime's 64-bit counters in any int field (found by introspection, so a new
field is covered without a new test), whatever kind of number gives them (Decimal, Fraction,
numpy), sizes that would hang or exhaust the runtime or the simulator, the ranges of the
Hugging Face settings, negative seeds, NUL in paths, a flow of the wrong arity."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any, get_args

import msgspec
import numpy as np
import pytest

from flowrl._core.errors import ConfigError, FlowDefinitionError
from flowrl._core.flow.graph import trace
from flowrl._core.settings import config as core_config
from flowrl._core.settings import run_config
from flowrl._core.settings.config import to_config
from flowrl._core.settings.run_config import RunConfig
from flowrl._sim import simulate as sim
from flowrl.hf import config as hf_config

MODULES = (core_config, run_config, hf_config, sim)
# The least each config Struct needs besides its defaults.
REQUIRED: dict[str, dict[str, Any]] = {
    "Autoscale": {"max_replicas": 1},
    "RunConfig": {"sample_per_episode": 1},
    "LoggerConfig": {"kind": "tensorboard"},
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


def _holds_float(annotation: Any) -> bool:
    """Whether ``annotation`` is ``float`` or has it inside (``float | None``, ``tuple[float, float]``)."""
    return annotation is float or any(_holds_float(arg) for arg in get_args(annotation))


def _float_fields() -> list[tuple[type[msgspec.Struct], msgspec.structs.FieldInfo]]:
    return [(cls, f) for cls in _config_structs() for f in msgspec.structs.fields(cls) if _holds_float(f.type)]


def _holds_int(annotation: Any) -> bool:
    """Whether ``annotation`` is ``int`` or has it inside (``int | None``, ``tuple[int, ...]``)."""
    return annotation is int or any(_holds_int(arg) for arg in get_args(annotation))


def _int_fields() -> list[tuple[type[msgspec.Struct], msgspec.structs.FieldInfo]]:
    return [(cls, f) for cls in _config_structs() for f in msgspec.structs.fields(cls) if _holds_int(f.type)]


FLOAT_FIELDS = _float_fields()
INT_FIELDS = _int_fields()
BAD = [math.nan, math.inf, -math.inf]


def _bad_value(field: msgspec.structs.FieldInfo, bad: Any) -> Any:
    # a sequence (Optim.betas, Sampling.stop_token_ids) gets the bad number as its first item,
    # a mapping of lists (Workload.tail_s) as its one value's
    if "dict[" in str(field.type):
        return {"a": [bad]}
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


OTHER_BAD = [Decimal("nan"), Decimal("sNaN"), Decimal("inf"), Decimal("-inf"), np.float32("nan"), np.float64("-inf")]


@pytest.mark.parametrize("bad", OTHER_BAD, ids=repr)
@pytest.mark.parametrize(("cls", "field"), FLOAT_FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in FLOAT_FIELDS])
def test_a_non_finite_decimal_or_numpy_number_is_refused_before_any_comparison(cls, field, bad):
    # a Decimal NaN raises InvalidOperation in ``nan <= 0``, a signalling one in msgspec itself
    values = {**REQUIRED.get(cls.__name__, {}), field.name: _bad_value(field, bad)}
    with pytest.raises(ConfigError, match=rf"{cls.__name__}\.{field.name} must be a finite number"):
        cls(**values)


@pytest.mark.parametrize(("cls", "field"), FLOAT_FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in FLOAT_FIELDS])
def test_a_fraction_in_a_float_setting_is_refused_naming_the_field(cls, field):
    values = {**REQUIRED.get(cls.__name__, {}), field.name: _bad_value(field, Fraction(1, 2))}
    with pytest.raises(ConfigError, match=rf"{cls.__name__}\.{field.name}=.*Fraction"):
        cls(**values)


def test_a_finite_decimal_in_a_float_setting_is_kept_as_the_float():
    config = core_config.ModelConfig(cpus_per_replica=Decimal("1.5"), call_timeout_s=Decimal("2"))
    assert (config.cpus_per_replica, config.call_timeout_s) == (1.5, 2.0)
    assert type(config.cpus_per_replica) is float
    with pytest.raises(ConfigError, match=r"ModelConfig\.cpus_per_replica must be a finite number, got inf"):
        core_config.ModelConfig(cpus_per_replica=Decimal("1e400"))  # finite, but beyond a float


def test_the_introspection_finds_the_int_fields():
    fields = {f"{c.__name__}.{f.name}" for c, f in INT_FIELDS}
    assert {
        "PipelineConfig.trace_spans",
        "ModelConfig.batch_size",
        "Autoscale.max_replicas",
        "RunConfig.seed",
    } <= fields
    assert {"RunConfig.num_episode", "Sampling.stop_token_ids", "LM.seed", "Workload.samples"} <= fields


@pytest.mark.parametrize("huge", [2**70, -(2**70), 10**26], ids=["2**70", "-2**70", "10**26"])
@pytest.mark.parametrize(("cls", "field"), INT_FIELDS, ids=[f"{c.__name__}.{f.name}" for c, f in INT_FIELDS])
def test_an_int_setting_beyond_the_runtimes_64_bit_counters_is_refused_naming_the_field(cls, field, huge):
    values = {**REQUIRED.get(cls.__name__, {}), field.name: _bad_value(field, huge)}
    # the generic bound, or a field's own (LM.seed: torch's range)
    message = rf"{cls.__name__}\.{field.name} must be (within|in) \[-2\*\*6[23], 2\*\*6[24][\])]"
    with pytest.raises(ConfigError, match=message):
        cls(**values)
    with pytest.raises(ConfigError, match=message):
        to_config(cls, values, "a run file")


def test_the_int_bound_keeps_every_valid_value():
    assert core_config.PipelineConfig(trace_spans=2**62).trace_spans == 2**62
    assert RunConfig(sample_per_episode=1, seed=2**62, num_episode=2**62).seed == 2**62
    assert hf_config.LM(path="some/folder", seed=2**64 - 1).seed == 2**64 - 1  # torch's range, its own rule
    assert hf_config.LM(path="some/folder", seed=-(2**63)).seed == -(2**63)
    assert core_config.ModelConfig(batch_size=np.int64(2**62)).batch_size == 2**62


def _stage(**kw: Any) -> sim.SimStage:
    return sim.SimStage(**{"name": "a", "replicas": 1, "batch_size": 1, **kw})


# settings whose size would hang or exhaust the runtime or the simulator: (build, message)
TOO_BIG = {
    "ModelConfig.prefetch": (lambda: core_config.ModelConfig(prefetch=2**62), r"ModelConfig\.prefetch must be <= 256"),
    "SimStage.prefetch": (lambda: _stage(prefetch=257), r"SimStage\.prefetch must be <= 256"),
    "Autoscale.every_s": (
        lambda: core_config.Autoscale(max_replicas=1, every_s=1e-300),
        r"Autoscale\.every_s must be >= 0\.01 s \(a shorter period polls",
    ),
    "Workload.seed": (
        lambda: sim.Workload(stages=[_stage()], samples=1, seed=-1),
        r"Workload\.seed must be >= 0, got -1",
    ),
    "StageCost.call_s": (lambda: sim.StageCost(call_s=1e308), r"StageCost\.call_s must be <= 1e\+09"),
    "StageCost.per_sample_s": (lambda: sim.StageCost(per_sample_s=1e308), r"StageCost\.per_sample_s must be <= 1e\+09"),
    "StageCost.tail_median_s": (lambda: sim.StageCost(tail_median_s=1e10), r"StageCost\.tail_median_s must be <= 1e"),
    "StageCost.tail_sigma": (lambda: sim.StageCost(tail_sigma=1e300), r"StageCost\.tail_sigma must be <= 20"),
    "Workload.samples": (
        lambda: sim.Workload(stages=[_stage()], samples=2**40),
        r"Workload\.samples must be <= 16777216",
    ),
    "Workload.overhead_s": (
        lambda: sim.Workload(stages=[_stage()], samples=1, overhead_s=1e308),
        r"Workload\.overhead_s must be <= 1e\+09",
    ),
    "Workload.dispatch_s": (
        lambda: sim.Workload(stages=[_stage()], samples=1, dispatch_s=1e308),
        r"Workload\.dispatch_s must be <= 1e\+09",
    ),
    "Workload.cost_hint_sigma": (
        lambda: sim.Workload(stages=[_stage()], samples=1, cost_hint_sigma=21.0),
        r"Workload\.cost_hint_sigma must be <= 20",
    ),
    "SimStage.replicas": (lambda: _stage(replicas=2**40), r"SimStage\.replicas must be <= 10000"),
    "SimStage.batch_size": (lambda: _stage(batch_size=2**21), r"SimStage\.batch_size must be <= 1048576"),
}


@pytest.mark.parametrize("case", list(TOO_BIG), ids=str)
def test_a_setting_that_would_hang_or_exhaust_the_runtime_or_the_simulator_is_refused(case):
    build, message = TOO_BIG[case]
    with pytest.raises(ConfigError, match=message):
        build()


def test_the_simulator_runs_at_its_largest_costs_with_finite_times():
    cost = sim.StageCost(call_s=1e9, per_sample_s=1e9, tail_median_s=1e9, tail_sigma=20.0)
    stages = [_stage(replicas=3, batch_size=4, cost=cost, prefetch=256), _stage(name="b", inputs=["a"], cost=cost)]
    work = sim.Workload(stages=stages, samples=64, seed=2**62, overhead_s=1e9, dispatch_s=1e9, cost_hint_sigma=20.0)
    result = sim.simulate(work)
    assert math.isfinite(result.makespan_s)
    assert math.isfinite(result.lower_bound_s)


HF_STRUCTS = (hf_config.LM, hf_config.Sampling, hf_config.Optim, hf_config.Train, hf_config.GRPO, hf_config.PPO)
# a value out of range for every number of the Hugging Face settings: (Struct, field, value)
HF_OUT_OF_RANGE = [
    (hf_config.LM, "seed", 2**64),
    (hf_config.Sampling, "max_new_tokens", 0),
    (hf_config.Sampling, "temperature", -0.5),
    (hf_config.Sampling, "top_p", 0.0),
    (hf_config.Sampling, "top_p", 1.5),
    (hf_config.Sampling, "top_k", -1),
    (hf_config.Sampling, "stop_token_ids", (-1,)),
    (hf_config.Sampling, "max_prompt_tokens", 0),
    (hf_config.Sampling, "max_response_tokens", 0),
    (hf_config.Sampling, "seed", 2**70),
    (hf_config.Optim, "lr", 0.0),
    (hf_config.Optim, "weight_decay", -0.1),
    (hf_config.Optim, "betas", (1.0, 0.999)),
    (hf_config.Optim, "betas", (0.9, -0.1)),
    (hf_config.Optim, "eps", -1.0),
    (hf_config.Optim, "eps", 0.0),
    (hf_config.Optim, "max_grad_norm", 0.0),
    (hf_config.Optim, "warmup_steps", -1),
    (hf_config.Optim, "total_steps", -1),
    (hf_config.Optim, "min_lr_ratio", 1e308),
    (hf_config.Optim, "min_lr_ratio", -0.1),
    (hf_config.Train, "micro_batch_tokens", -1),
    (hf_config.Train, "temperature", 0.0),
    (hf_config.GRPO, "clip", 0.0),
    (hf_config.GRPO, "clip_high", -0.1),
    (hf_config.GRPO, "kl_coef", -1.0),
    (hf_config.GRPO, "max_tokens", 0),
    (hf_config.PPO, "clip", -0.2),
    (hf_config.PPO, "clip_high", 0.0),
    (hf_config.PPO, "kl_coef", -0.05),
    (hf_config.PPO, "gamma", 1e308),
    (hf_config.PPO, "gamma", -0.1),
    (hf_config.PPO, "lam", 1e308),
    (hf_config.PPO, "value_clip", 0.0),
    (hf_config.PPO, "max_tokens", 0),
    (hf_config.GRPO, "tis_cap", 0.0),
    (hf_config.PPO, "tis_cap", -1.0),
]


def test_every_number_of_the_hf_settings_has_an_out_of_range_case():
    numbers = {
        (cls, f.name)
        for cls in HF_STRUCTS
        for f in msgspec.structs.fields(cls)
        if _holds_int(f.type) or _holds_float(f.type)
    }
    assert numbers == {(cls, name) for cls, name, _ in HF_OUT_OF_RANGE}


@pytest.mark.parametrize(
    ("cls", "field", "bad"), HF_OUT_OF_RANGE, ids=[f"{c.__name__}.{f}={b!r}" for c, f, b in HF_OUT_OF_RANGE]
)
def test_an_hf_setting_out_of_its_range_is_refused_when_built_not_on_the_actor(cls, field, bad):
    values = {**REQUIRED.get(cls.__name__, {}), field: bad}
    with pytest.raises(ConfigError, match=rf"{cls.__name__}\.{re.escape(field)}(\[\d\])? must be"):
        cls(**values)


def test_the_hf_ranges_keep_their_edges():
    hf_config.Optim(betas=(0.0, 0.0), min_lr_ratio=1.0, eps=1e-30)
    hf_config.Optim(min_lr_ratio=0.0)
    hf_config.PPO(gamma=0.0, lam=1.0)
    hf_config.PPO(gamma=1.0, lam=0.0, kl_coef=0.0)
    hf_config.Sampling(temperature=0.0, top_p=1.0, top_k=0, stop_token_ids=(0, 2))


@pytest.mark.parametrize("key", ["run_dir", "checkpoint.dir", "checkpoint.resume"])
def test_a_nul_in_a_path_setting_is_refused_when_the_run_config_is_built(key):
    def setting(value: str) -> dict[str, Any]:  # "checkpoint.dir": {"checkpoint": {"dir": value}}
        section, _, leaf = key.rpartition(".")
        return {section: {leaf: value}} if section else {leaf: value}

    with pytest.raises(ConfigError, match=rf"RunConfig\.{re.escape(key)} is a path and cannot hold a NUL character"):
        RunConfig(sample_per_episode=1, **setting("runs/a\x00b"))
    with pytest.raises(ConfigError, match=rf"RunConfig\.{re.escape(key)} is a path"):
        RunConfig.from_mapping({"sample_per_episode": 1, **setting("x\x00")})


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
