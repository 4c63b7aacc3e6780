"""The error-tree rule: a user mistake made through the public API is a FlowError subclass
(docs/errors.md), never a bare TypeError/KeyError/AttributeError from inside flowrl.
In-process backend throughout; each case is the call, the error expected and a message fragment."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

import flowrl
import flowrl.rl as rl
from flowrl.testing import CountingTrainer, Scale

if TYPE_CHECKING:
    from collections.abc import Callable

hf = pytest.importorskip("flowrl.hf")

LOCAL = {"backend": "inprocess"}
ITEMS = [{"x": np.full(1, float(i))} for i in range(4)]
POLICY = Scale("policy", {"num_replicas": 1, "batch_size": 2}, srcs=["x"], dst="y")


def flow(x: Any) -> Any:
    return POLICY.forward_step(x)


def _engine(**kw: Any) -> flowrl.Engine:
    policy = Scale("policy", {"num_replicas": 1, "batch_size": 2}, srcs=["x"], dst="y")
    args: dict[str, Any] = {
        "rollout": lambda x: policy.forward_step(x),
        "train": [CountingTrainer("trainer")],
        "config": {"sample_per_episode": 4, "train_global_batch_size": 4, "pipeline": LOCAL},
        **kw,
    }
    return flowrl.Engine(**args)


def _pipeline_run(items: Any, **kw: Any) -> Any:
    with flowrl.Pipeline(flow, LOCAL) as pipe:
        return pipe.run(items, **kw)


def _async_run(items: Any) -> Any:
    async def go() -> Any:
        async with flowrl.open_pipeline(flow, LOCAL) as pipe:
            return await pipe.run(items)

    return asyncio.run(go())


def _one_stage(**kw: Any) -> flowrl.SimStage:
    return flowrl.SimStage(name="a", replicas=1, batch_size=1, **kw)


T, M = torch.zeros(2, 3), torch.ones(2, 3)
BATCH = flowrl.Batch([0, 1], {"x": np.arange(2)})
LONG = torch.ones(2, dtype=torch.long)

CASES: list[tuple[str, Callable[[], Any], type[flowrl.FlowError], str]] = [
    # items: not an iterable of mappings (was TypeError: 'NoneType' object is not iterable)
    (
        "run_flow-items-None",
        lambda: flowrl.run_flow(flow, None, LOCAL),
        flowrl.ConfigError,
        "run_flow(items=...): expected an iterable of items",
    ),
    ("run_flow-items-int", lambda: flowrl.run_flow(flow, 5, LOCAL), flowrl.ConfigError, "got int"),
    ("run_flow-items-dict", lambda: flowrl.run_flow(flow, {"x": 1}, LOCAL), flowrl.ConfigError, "got dict"),
    ("Pipeline.run-items-None", lambda: _pipeline_run(None), flowrl.ConfigError, "Pipeline.run(items=...)"),
    ("AsyncPipeline.run-items-int", lambda: _async_run(3), flowrl.ConfigError, "AsyncPipeline.run/stream(items=...)"),
    (
        "set_dataset-None",
        lambda: _engine().set_dataset(None),
        flowrl.ConfigError,
        "engine.set_dataset(items): expected an iterable",
    ),
    (
        "set_eval_dataset-int",
        lambda: _engine().set_eval_dataset(3),
        flowrl.ConfigError,
        "engine.set_eval_dataset(items)",
    ),
    (
        "set_eval_dataset-strings",
        lambda: _engine().set_eval_dataset(["a"]),
        flowrl.ConfigError,
        "eval dataset item 0 is a str",
    ),
    # field names (was TypeError: 'int' object is not iterable)
    (
        "run_flow-input_fields-int",
        lambda: flowrl.run_flow(flow, ITEMS, LOCAL, input_fields=3),
        flowrl.ConfigError,
        "input_fields: expected field names",
    ),
    (
        "build_flow-input_fields-names",
        lambda: flowrl.build_flow(flow, [1]),
        flowrl.ConfigError,
        "field names must be non-empty strings",
    ),
    ("Pipeline.run-fields-int", lambda: _pipeline_run(ITEMS, fields=3), flowrl.ConfigError, "Pipeline.run(fields=...)"),
    (
        "step-reads-int",
        lambda: flowrl.step(reads=5),
        flowrl.ConfigError,
        "@flowrl.step(reads=...): expected field names",
    ),
    ("step-not-callable", lambda: flowrl.step(3), flowrl.ConfigError, "@flowrl.step decorates a method, got int"),
    # paths (was TypeError from pathlib)
    (
        "Engine.write_trace-int",
        lambda: _engine().write_trace(3),
        flowrl.ConfigError,
        "Engine.write_trace(path): expected a file path",
    ),
    # Engine arguments (was TypeError / AttributeError / ValueError from unpacking)
    (
        "Engine-train-None",
        lambda: _engine(train=None),
        flowrl.FlowDefinitionError,
        "Engine(train=...): expected a list of models",
    ),
    (
        "Engine-train-one-model",
        lambda: _engine(train=CountingTrainer("t")),
        flowrl.FlowDefinitionError,
        "use train=[t]",
    ),
    (
        "Engine-sync-None",
        lambda: _engine(sync=None),
        flowrl.ConfigError,
        "Engine(sync=...): expected a list of (trainer, model) pairs",
    ),
    ("Engine-sync-model", lambda: _engine(sync=[POLICY]), flowrl.ConfigError, "Engine(sync=...) item 0"),
    ("Engine-sync-names", lambda: _engine(sync=[("trainer", "policy")]), flowrl.ConfigError, "pair of flowrl.Models"),
    (
        "relay-fn-None",
        lambda: _engine().set_relay_sample_fn(None),
        flowrl.FlowDefinitionError,
        "relay function must be a function of one argument",
    ),
    # Batch and Sample (was ValueError / AttributeError / IndexError / KeyError)
    (
        "Batch-ids-str",
        lambda: flowrl.Batch("abc"),
        flowrl.FlowDefinitionError,
        "Batch(ids=...): expected a sequence of ints",
    ),
    ("Batch-ids-None", lambda: flowrl.Batch(None), flowrl.FlowDefinitionError, "Batch(ids=...)"),
    (
        "Batch-fields-str",
        lambda: flowrl.Batch([0, 1], "x"),
        flowrl.FlowDefinitionError,
        "Batch(fields=...): expected a mapping",
    ),
    (
        "Batch.concat-non-batch",
        lambda: flowrl.Batch.concat([1]),
        flowrl.FlowDefinitionError,
        "Batch.concat: expected a list of Batches",
    ),
    (
        "Batch.select-out-of-range",
        lambda: BATCH.select([5]),
        flowrl.FlowDefinitionError,
        "rows [5] out of range for 2 samples",
    ),
    ("Batch.select-str", lambda: BATCH.select("a"), flowrl.FlowDefinitionError, "Batch.select(rows)"),
    (
        "Batch.merge-dict",
        lambda: BATCH.merge({"y": [1, 2]}),
        flowrl.FlowDefinitionError,
        "Batch.merge: expected a Batch, got dict",
    ),
    ("Batch.row-out-of-range", lambda: BATCH.row(5), flowrl.FlowDefinitionError, "Batch.row(5): out of range"),
    (
        "Batch-missing-field",
        lambda: BATCH["nope"],
        flowrl.MissingFieldError,
        "field 'nope' is not in this batch; it has ['x']",
    ),
    ("Sample-missing-field", lambda: flowrl.Sample(0, {})["x"], flowrl.MissingFieldError, "sample 0 has no field 'x'"),
    # simulate (was AttributeError / ValueError / KeyError)
    (
        "simulate-None",
        lambda: flowrl.simulate(None),
        flowrl.ConfigError,
        "simulate: expected a flowrl.Workload, got NoneType",
    ),
    (
        "Workload-no-stages",
        lambda: flowrl.Workload(stages=[], samples=4),
        flowrl.ConfigError,
        "at least one stage and samples > 0",
    ),
    ("Workload-no-samples", lambda: flowrl.Workload(stages=[_one_stage()], samples=0), flowrl.ConfigError, "samples=0"),
    (
        "Workload-stage-dict",
        lambda: flowrl.Workload(stages=[{"name": "a"}], samples=4),
        flowrl.ConfigError,
        "expected SimStage items, got a dict",
    ),
    (
        "Workload-duplicate-stage",
        lambda: flowrl.Workload(stages=[_one_stage()] * 2, samples=4),
        flowrl.ConfigError,
        "two stages are named 'a'",
    ),
    (
        "idle_fraction-unknown",
        lambda: flowrl.simulate(flowrl.Workload(stages=[_one_stage()], samples=4)).idle_fraction("b"),
        flowrl.ConfigError,
        "no stage 'b'; the stages are ['a']",
    ),
    # flowrl.rl (was TypeError / RuntimeError / NotImplementedError from torch)
    (
        "rl-groups-None",
        lambda: rl.group_advantages(torch.ones(2), None),
        flowrl.ConfigError,
        "group_advantages: groups must be a tensor or sequence of int",
    ),
    (
        "rl-rloo-groups-str",
        lambda: rl.rloo_advantages(torch.ones(2), "ab"),
        flowrl.ConfigError,
        "rloo_advantages: groups",
    ),
    (
        "rl-kl_coef-str",
        lambda: rl.token_rewards(torch.ones(2), T, T, M, kl_coef="x"),
        flowrl.ConfigError,
        "token_rewards: kl_coef must be a number, got 'x'",
    ),
    ("rl-gamma-str", lambda: rl.gae(T, T, M, gamma="x"), flowrl.ConfigError, "gae: gamma must be a number"),
    (
        "rl-clip-str",
        lambda: rl.policy_loss(T, T, T, M, clip="x"),
        flowrl.ConfigError,
        "policy_loss: clip must be a number",
    ),
    (
        "rl-num_tokens-str",
        lambda: rl.policy_loss(T, T, T, M, num_tokens="3"),
        flowrl.ConfigError,
        "num_tokens must be a number",
    ),
    (
        "rl-value-clip-str",
        lambda: rl.value_loss(T, T, T, M, clip="x"),
        flowrl.ConfigError,
        "value_loss: clip must be a number",
    ),
    (
        "rl-entropy-int-logits",
        lambda: rl.entropy_from_logits(torch.ones(2, 3, dtype=torch.long)),
        flowrl.ConfigError,
        "logits must be a floating-point tensor",
    ),
    # flowrl.hf token helpers (was TypeError / RuntimeError / ValueError from torch)
    (
        "hf-left_pad-None",
        lambda: hf.left_pad(None, 0),
        flowrl.ConfigError,
        "left_pad: rows must be a list of 1-D tensors, got NoneType",
    ),
    (
        "hf-left_pad-2d-row",
        lambda: hf.left_pad([torch.ones(2, 2, dtype=torch.long)], 0),
        flowrl.ConfigError,
        "rows[0] must be a 1-D tensor, got shape (2, 2)",
    ),
    ("hf-left_pad-pad-str", lambda: hf.left_pad([LONG], "x"), flowrl.ConfigError, "pad_id must be an int"),
    ("hf-right_pad-str", lambda: hf.right_pad("abc"), flowrl.ConfigError, "right_pad: rows must be a list"),
    (
        "hf-join-lengths",
        lambda: hf.join([LONG], [], 0),
        flowrl.ConfigError,
        "join: expected one response per prompt, got 1 prompts and 0 responses",
    ),
    ("hf-join-None", lambda: hf.join(None, None, 0), flowrl.ConfigError, "join: prompts must be a list"),
    (
        "hf-token_logprobs-shapes",
        lambda: hf.token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long)),
        flowrl.ConfigError,
        "logits (2, 3, 5) and targets (2, 4)",
    ),
    (
        "hf-token_logprobs-float-targets",
        lambda: hf.token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3)),
        flowrl.ConfigError,
        "targets must be integer token ids",
    ),
    (
        "hf-token_logprobs-temperature-0",
        lambda: hf.token_logprobs(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), 0),
        flowrl.ConfigError,
        "temperature must be a number > 0, got 0",
    ),
    (
        "hf-sequence_logprobs-padded-None",
        lambda: hf.sequence_logprobs(torch.zeros(1, 5, 5), None),
        flowrl.ConfigError,
        "padded must be the Padded that join() returns",
    ),
    (
        "hf-sequence_logprobs-logits-shape",
        lambda: hf.sequence_logprobs(torch.zeros(1, 2, 5), hf.join([LONG], [LONG], 0)),
        flowrl.ConfigError,
        "logits must be [n, T, V] with [n, T] = (1, 4)",
    ),
]


@pytest.mark.parametrize(("call", "error", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_wrong_argument_is_a_named_flow_error(call, error, fragment):
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value)


def test_a_missing_field_is_still_a_key_error_so_mapping_reads_work():
    assert isinstance(flowrl.MissingFieldError("x"), KeyError)
    assert BATCH.get("nope", 7) == 7 and "nope" not in BATCH
    assert dict(flowrl.Sample(0, {"a": 1})) == {"a": 1}


WRONG = {"None": None, "int": 3, "str": "abc", "dict": {"a": 1}, "generator": (i for i in ()), "float": 2.5}

# each public entry point that takes user data, with one argument replaced by a wrong value
ENTRY_POINTS: dict[str, Callable[[Any], Any]] = {
    "run_flow(items)": lambda v: flowrl.run_flow(flow, v, LOCAL),
    "run_flow(input_fields)": lambda v: flowrl.run_flow(flow, ITEMS, LOCAL, input_fields=v),
    "run_flow(config)": lambda v: flowrl.run_flow(flow, ITEMS, v),
    "build_flow(flow)": lambda v: flowrl.build_flow(v),
    "Engine(train)": lambda v: _engine(train=v),
    "Engine(sync)": lambda v: _engine(sync=v),
    "Engine(config)": lambda v: _engine(config=v),
    "Engine(eval_flow)": lambda v: _engine(eval_flow=v),
    "Engine.set_dataset": lambda v: _engine().set_dataset(v),
    "Engine.set_eval_dataset": lambda v: _engine().set_eval_dataset(v),
    "Engine.set_relay_sample_fn": lambda v: _engine().set_relay_sample_fn(v),
    "Engine.write_trace": lambda v: _engine().write_trace(v),
    "Model(name)": lambda v: flowrl.Model(v),
    "Model(config)": lambda v: flowrl.Model("m", v),
    "step(reads)": lambda v: flowrl.step(reads=v),
    "Batch(ids)": lambda v: flowrl.Batch(v),
    "Batch(fields)": lambda v: flowrl.Batch([0], v),
    "Batch.merge": lambda v: BATCH.merge(v),
    "Batch.select": lambda v: BATCH.select(v),
    "simulate": lambda v: flowrl.simulate(v),
    "rl.group_advantages(scores)": lambda v: rl.group_advantages(v, [0, 0]),
    "rl.group_advantages(groups)": lambda v: rl.group_advantages(torch.ones(2), v),
    "rl.policy_loss(clip)": lambda v: rl.policy_loss(T, T, T, M, clip=v),
    "rl.gae(lam)": lambda v: rl.gae(T, T, M, lam=v),
    "hf.left_pad": lambda v: hf.left_pad(v, 0),
    "hf.right_pad": lambda v: hf.right_pad(v),
    "hf.HFPolicy(lm)": lambda v: hf.HFPolicy("p", lm=v),
}


@pytest.mark.parametrize("value", list(WRONG.values()), ids=list(WRONG))
@pytest.mark.parametrize("entry", list(ENTRY_POINTS.values()), ids=list(ENTRY_POINTS))
def test_no_entry_point_lets_a_bare_python_error_escape_for_a_wrong_type(entry, value, tmp_path, monkeypatch):
    """Whatever a wrong value does (some are accepted: a dict of models is iterable), it never
    surfaces as a bare TypeError, KeyError, AttributeError, IndexError or ValueError."""
    monkeypatch.chdir(tmp_path)  # a string is a valid trace path: write_trace("abc") writes a file
    try:
        entry(value)
    except flowrl.FlowError:
        pass


def _on_async_pipeline(call: Callable[[Any], Any]) -> Any:
    async def go() -> Any:
        async with flowrl.open_pipeline(flow, LOCAL) as pipe:
            return await call(pipe)

    return asyncio.run(go())


async def _stream_fields(pipe: Any) -> Any:
    return [s async for s in pipe.stream(ITEMS, fields=3)]


async def _write_trace(pipe: Any) -> Any:
    return pipe.write_trace(3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (_stream_fields, r"AsyncPipeline.stream\(fields=...\): expected field names \(a list of strings\), got int"),
        (lambda pipe: pipe.add_replicas("policy", "2"), r"add_replicas\('policy', count\): expected an int >= 1"),
        (lambda pipe: pipe.remove_replicas("policy", 0), r"remove_replicas\('policy', count\): expected an int >= 1"),
        (_write_trace, r"AsyncPipeline.write_trace\(path\): expected a file path"),
    ],
    ids=["stream-fields", "add-replicas-str", "remove-replicas-0", "write-trace-int"],
)
def test_a_wrong_argument_to_an_open_async_pipeline_is_a_config_error(call, message):
    with pytest.raises(flowrl.ConfigError, match=message):
        _on_async_pipeline(call)
