"""The flowrl command: `flowrl run` on a config file end to end and its errors; the mistakes of
`flowrl scale` (the progress views are in pipeline/test_progress.py)."""

from __future__ import annotations

import json

import pytest

import flowrl
from flowrl._tools.cli import main

FAST = ["--set", "run.pipeline.backend=inprocess", "--set", "models.ppo_policy.num_replicas=1"]


def test_flowrl_run_trains_the_ppo_example_from_its_yaml(tmp_path, capsys):
    code = main(
        ["run", "examples/ppo_tiny.yaml", "--set", "run.num_episode=2", "--set", f"run.run_dir={tmp_path}", *FAST]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    # 64 samples an episode, global batch 32 over 4 epochs: 8 steps an episode per trainer
    assert (
        "done: 2 episodes in all (resumed ones included); ppo_policy: 16 steps, 512 samples, ppo_value: 16 steps, "
        "512 samples" in out
    )
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["episode"] for line in lines] == [0, 1] and all(line["samples"] == 64 for line in lines)
    assert (tmp_path / "trace.json").is_file() and f"flowrl trace {tmp_path}" in out


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--set", "modles.policy.num_replicas=1"], "examples/ppo_tiny.yaml: Object contains unknown field `modles`"),
        (
            ["--set", "models.policy.class=ppo_tiny:Polcy"],
            "models.policy.class: module 'ppo_tiny' has no 'Polcy'",
        ),
        (["--set", "models.policy.batchsize=4"], "models.policy: Object contains unknown field `batchsize`"),
        (
            ["--set", "models.policy.class=numpy:ndarray"],
            "models.policy.class: 'numpy:ndarray' is not a flowrl.Model subclass",
        ),
        (["--set", "run.num_episode=0"], "RunConfig.num_episode must be > 0, got 0"),
        (["--set", "run.progres=log"], "run: Object contains unknown field `progres`"),
        (["--set", "flow=examples.nowhere:rollout"], "flow: cannot import module 'examples.nowhere'"),
        (["--set", "num_episode"], "override 'num_episode': expected key=value"),
    ],
)
def test_flowrl_run_names_the_bad_key(capsys, overrides, message):
    assert main(["run", "examples/ppo_tiny.yaml", *overrides, *FAST]) == 2
    assert message in capsys.readouterr().err


def test_flowrl_run_refuses_a_missing_or_unknown_file(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("models: [unclosed\n")
    assert main(["run", str(tmp_path / "bad.yaml")]) == 2
    assert "bad.yaml: not valid YAML" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: no such file" in capsys.readouterr().err
    (tmp_path / "run.json").write_text("{}")
    assert main(["run", str(tmp_path / "run.json")]) == 2
    assert "expected a .yaml, .yml or .toml file" in capsys.readouterr().err


def test_the_custom_flow_of_the_cli_page_runs_from_its_toml(tmp_path, capsys, monkeypatch):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    (toml,) = re.findall(r"^```toml\n(.*?)^```", page, re.S | re.M)  # the page's example, as written
    (tmp_path / "myflow.py").write_text(  # the module its comments describe
        "import numpy as np\n"
        "def rollout(prompts, *, gen):\n    return gen.forward_step(prompts)\n"
        "def items():\n    return [{'x': np.full(1, float(i))} for i in range(12)]\n"
    )
    (tmp_path / "run.toml").write_text(toml)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "run.toml", "--set", "run.pipeline.backend=inprocess"]) == 0
    assert "done: 2 episodes in all (resumed ones included); trainer: 2 steps, 12 samples" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["policy=0"], "expected MODEL=N with N a whole number from 1 to 10,000"),  # more: engine/test_scale_requests
        (["policy"], "expected MODEL=N"),
        (["missing-dir", "policy=2"], "not a folder"),
    ],
)
def test_flowrl_scale_mistakes_exit_2_with_a_message(tmp_path, capsys, args, message):
    where = [str(tmp_path)] if args[0] != "missing-dir" else [str(tmp_path / "missing")]
    assert main(["scale", *where, *args[-1:]]) == 2
    assert message in capsys.readouterr().err


def test_a_run_file_sets_the_engines_evaluation(tmp_path, monkeypatch):
    from flowrl._tools.run_file import build_engine, load_run_file

    (tmp_path / "evalflow.py").write_text(
        "import numpy as np\n"
        "import flowrl\n"
        "class Gen(flowrl.Model):\n"
        "    def forward_step(self, batch, iteration):\n        return {'y': batch['x'] * 2}\n"
        "    def eval_step(self, batch, iteration):\n        return {'y': batch['x'] * 10}\n"
        "class Trainer(flowrl.Model):\n"
        "    def train_step(self, batch, iteration):\n        return {'n': float(len(batch))}\n"
        "def rollout(prompts, *, gen):\n    return gen.forward_step(prompts)\n"
        "def evaluate(prompts, *, gen):\n    return gen.eval_step(prompts)\n"
        "def items():\n    return [{'x': np.full(1, float(i))} for i in range(8)]\n"
        "def held_out():\n    return [{'x': np.full(1, 100.0 + i)} for i in range(3)]\n"
    )
    (tmp_path / "run.yaml").write_text(
        "flow: evalflow:rollout\neval_flow: evalflow:evaluate\n"
        "dataset: evalflow:items\neval_dataset: evalflow:held_out\n"
        "train: [trainer]\nmodels:\n  gen: {class: evalflow:Gen}\n  trainer: {class: evalflow:Trainer}\n"
        "run: {sample_per_episode: 4, num_episode: 2, train_global_batch_size: 4, eval_every: 1, "
        "pipeline: {backend: inprocess}}\n"
    )
    monkeypatch.chdir(tmp_path)
    engine = build_engine(load_run_file("run.yaml"))
    engine.learn()
    assert len(engine.eval_results) == 2  # after each of the two episodes
    assert sorted(float(s["y"][0]) for s in engine.eval_results[-1]) == [1000.0, 1010.0, 1020.0]
    with pytest.raises(flowrl.ConfigError, match="eval_flow: give it with a custom flow"):
        build_engine(load_run_file("run.yaml", ["flow=rlhf"]))
