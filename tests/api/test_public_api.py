"""The public surface: ``flowrl.__all__`` is sorted and names every public name of
``flowrl/__init__.py`` and nothing else; every public class and function says ``flowrl`` is its
module and is found there under that name, so what pickles it (Ray does) still loads it."""

from __future__ import annotations
import __future__

import ast
import inspect
import pickle
import subprocess
import sys
import typing
from pathlib import Path

import msgspec
import numpy as np
import pytest

import flowrl


def declared_names() -> set[str]:
    """The names ``flowrl/__init__.py`` binds at its top level, as written."""
    names: set[str] = set()
    for node in ast.parse(Path(flowrl.__file__).read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def is_code(obj: object) -> bool:
    return inspect.isclass(obj) or inspect.isfunction(obj)


def test_all_is_sorted_and_names_every_public_name_and_nothing_else():
    assert flowrl.__all__ == sorted(flowrl.__all__)
    assert len(set(flowrl.__all__)) == len(flowrl.__all__)
    assert set(flowrl.__all__) == {n for n in declared_names() if not n.startswith("_")}
    # and at run time: what the package holds besides its submodules and `from __future__`
    held = {
        name
        for name, value in vars(flowrl).items()
        if not name.startswith("_") and not inspect.ismodule(value) and not isinstance(value, __future__._Feature)
    }
    assert held == set(flowrl.__all__)


@pytest.mark.parametrize("name", [n for n in flowrl.__all__ if is_code(getattr(flowrl, n))])
def test_a_public_class_or_function_says_flowrl_is_its_module(name):
    obj = getattr(flowrl, name)
    assert obj.__module__ == "flowrl"
    assert getattr(flowrl, obj.__qualname__) is obj  # the name a pickle looks up
    assert pickle.loads(pickle.dumps(obj)) is obj


@pytest.mark.parametrize("name", [n for n in flowrl.__all__ if isinstance(getattr(flowrl, n), type)])
def test_a_public_class_s_type_hints_resolve_under_its_public_module(name):
    cls = getattr(flowrl, name)
    hints = typing.get_type_hints(cls)  # a string annotation left unresolved would fail here
    assert set(vars(cls).get("__annotations__", {})) <= set(hints)


def test_a_relay_episode_converts_with_msgspec_under_its_public_name():
    episode = msgspec.convert({"episode_id": 3, "buffer": [1, "a"]}, flowrl.EpisodeBuffer)
    assert episode == flowrl.EpisodeBuffer(episode_id=3, buffer=[1, "a"])


def test_the_public_names_that_are_not_code_are_data():
    assert [n for n in flowrl.__all__ if not is_code(getattr(flowrl, n))] == ["SPLITTERS"]
    assert sorted(flowrl.SPLITTERS) == sorted(set(flowrl.SPLITTERS))


def test_batches_configs_stats_and_errors_pickle_and_decode_under_their_public_names():
    import ray.cloudpickle

    batch = flowrl.Batch([3, 4], {"x": np.arange(2.0), "s": ["a", "b"]})
    config = flowrl.ModelConfig(num_replicas=2, splitter="greedy", autoscale=flowrl.Autoscale(max_replicas=4))
    run = flowrl.RunConfig(sample_per_episode=8, pipeline=flowrl.PipelineConfig(max_inflight=16))
    error = flowrl.StageError("boom", "m.forward_step", 1, [3, 4])
    for dumps, loads in ((pickle.dumps, pickle.loads), (ray.cloudpickle.dumps, ray.cloudpickle.loads)):
        back = loads(dumps(batch))
        assert type(back) is flowrl.Batch and back.ids.tolist() == [3, 4] and back["s"] == ["a", "b"]
        assert loads(dumps(config)) == config and loads(dumps(run)) == run
        again = loads(dumps(error))
        assert type(again) is flowrl.StageError and str(again) == str(error) and again.sample_ids == [3, 4]
    assert b"flowrl._" not in ray.cloudpickle.dumps(flowrl.Batch)  # by reference, under the public name
    # msgspec reads a Struct's annotations lazily, from the module the class names: still resolved
    assert msgspec.convert(msgspec.to_builtins(config), flowrl.ModelConfig) == config
    assert msgspec.json.decode(msgspec.json.encode(run), type=flowrl.RunConfig) == run
    assert {f.name: f.type for f in msgspec.structs.fields(flowrl.Autoscale)}["max_replicas"] in (int, int | None)


def test_a_fresh_process_decodes_configs_after_the_rename():
    code = (
        "import flowrl, msgspec\n"
        "c = msgspec.convert({'num_replicas': 2, 'splitter': 'greedy', 'autoscale': {'max_replicas': 3}},"
        " flowrl.ModelConfig)\n"
        "assert c.autoscale.max_replicas == 3 and flowrl.ModelConfig.__module__ == 'flowrl'\n"
        "msgspec.convert({'splitter': 'fastest'}, flowrl.ModelConfig)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (
        out.stderr.strip().splitlines()[-1] == "msgspec.ValidationError: Invalid enum value 'fastest' - at `$.splitter`"
    )


def test_a_run_config_with_loggers_pickles_and_decodes_under_the_public_names():
    run = flowrl.RunConfig(sample_per_episode=8, loggers=["tensorboard", {"kind": "wandb", "mode": "offline"}])
    assert all(type(c) is flowrl.LoggerConfig for c in run.loggers)  # names and mappings, as LoggerConfig
    assert pickle.loads(pickle.dumps(run)) == run
    assert msgspec.json.decode(msgspec.json.encode(run), type=flowrl.RunConfig) == run
    assert isinstance(flowrl.TensorBoardLogger("unused"), flowrl.Logger)  # the backends are Loggers
