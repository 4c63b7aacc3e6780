"""Model names follow one rule wherever a name enters: letters, digits, '_' and '-', 1 to 128
characters, not starting with '-' (a name becomes stage, actor and checkpoint file names)."""

from __future__ import annotations

import re
from typing import Any

import pytest

import flowrl
from flowrl.testing import CountingTrainer, Scale

LOCAL = {"backend": "inprocess"}
RULE = r"a model name must be 1 to 128 characters among letters, digits, '_' and '-', not starting with '-'"

BAD = ["", ".", "..", "../evil", "a/b", "a\\b", "a.b", "a b", "-x", "a#2", "x" * 129, "pólicy", "a\n", None, 3]
GOOD = ["policy", "reward_2", "ref-model", "_x", "0", "X" * 128]


def _id(value: Any) -> str:
    return repr(value)[:20]


@pytest.mark.parametrize("name", BAD, ids=_id)
def test_a_model_with_a_bad_name_is_refused_naming_the_rule(name):
    with pytest.raises(flowrl.ConfigError, match=rf"Scale\(name=\.\.\.\): {RULE} .*got {re.escape(repr(name))}$"):
        Scale(name, {}, srcs=["x"], dst="y")


@pytest.mark.parametrize("name", GOOD, ids=_id)
def test_names_within_the_rule_are_accepted(name):
    assert Scale(name, {}, srcs=["x"], dst="y").name == name


@pytest.mark.parametrize("name", ["../evil", "a.b", ""], ids=_id)
def test_run_config_model_keys_and_colocation_names_follow_the_rule(name):
    with pytest.raises(flowrl.ConfigError, match=rf"RunConfig\.models: {RULE}"):
        flowrl.RunConfig(sample_per_episode=1, models={name: flowrl.ModelConfig()})
    with pytest.raises(flowrl.ConfigError, match=rf"RunConfig\.colocation\[1\]: {RULE}"):
        flowrl.RunConfig(sample_per_episode=1, colocation=[["policy"], ["reward", name]])
    # read from a run file: the same message, behind where it was read
    with pytest.raises(flowrl.ConfigError, match=rf"run config: RunConfig\.models: {RULE}"):
        flowrl.RunConfig.from_mapping({"sample_per_episode": 1, "models": {name: {}}})


def test_a_name_changed_after_the_model_was_made_is_refused_by_the_engine():
    policy = Scale("policy", {"batch_size": 2}, srcs=["x"], dst="y")
    policy.name = "../outside"  # a plain attribute: nothing stops the assignment itself
    with pytest.raises(flowrl.ConfigError, match=rf"model Scale: {RULE} .*got '\.\./outside'"):
        flowrl.Engine(
            rollout=lambda x: policy.forward_step(x),
            train=[CountingTrainer("trainer")],
            config={"sample_per_episode": 2, "pipeline": LOCAL},
        )
