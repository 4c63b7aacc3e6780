"""The flowrl command: `flowrl run` on a config file end to end, its errors, and the progress
view of an engine (live table, log lines, or nothing)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import flowrl
from flowrl._tools.cli import main
from flowrl.testing import CountingTrainer, Scale

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
            ["--set", "models.policy.class=examples.ppo_tiny:Polcy"],
            "models.policy.class: module 'examples.ppo_tiny' has no 'Polcy'",
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

    page = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
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


def _engine(progress: str) -> flowrl.Engine:
    policy = Scale("policy", {"num_replicas": 2, "batch_size": 2}, srcs=["x"], dst="y")
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[CountingTrainer("t")],
        config={"sample_per_episode": 4, "num_episode": 2, "progress": progress, "pipeline": {"backend": "inprocess"}},
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(8)])
    return engine


def test_progress_log_lines_live_view_or_nothing(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="flowrl"):
        _engine("log").learn()
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["episode 1/2", "episode 2/2"]
    assert capsys.readouterr() == ("", "")
    _engine("live").learn()
    err = capsys.readouterr().err
    assert "episode 1/2: 4 samples" in err and "episode 2/2: 4 samples" in err
    caplog.clear()
    _engine("auto").learn()  # not a terminal here: log lines at INFO, which nothing shows
    assert capsys.readouterr() == ("", "") and len(caplog.records) == 0
    with pytest.raises(flowrl.ConfigError, match=r"RunConfig.progress must be one of \['auto', 'live', 'log', 'off'\]"):
        _engine("verbose")


@pytest.mark.parametrize("progress", ["log", "live", "off"])
def test_a_pipeline_stream_logs_a_line_per_run_or_draws_or_stays_quiet(caplog, capsys, progress):
    double = Scale("double", {"num_replicas": 2, "batch_size": 3}, srcs=["x"], dst="y", sleep_s=0.001)
    with caplog.at_level(logging.INFO, logger="flowrl"):
        with flowrl.Pipeline(lambda x: double.forward_step(x), {"backend": "inprocess", "progress": progress}) as pipe:
            for run in range(2):
                assert len(pipe.run([{"x": np.full(1, float(i))} for i in range(10)])) == 10
    lines = [r.getMessage() for r in caplog.records]
    if progress == "log":
        assert [line.split(" in ")[0] for line in lines] == ["run 0: 10 samples", "run 1: 10 samples"]
        assert all(line.endswith("(double.forward_step 10)") for line in lines)
    else:
        assert lines == []
    assert capsys.readouterr().out == ""


def test_the_live_table_shows_each_stage_its_samples_busy_replicas_and_queue():
    import anyio
    from rich.console import Console

    from flowrl._pipeline.progress import stage_table

    a = Scale("a", {"num_replicas": 2, "batch_size": 2}, srcs=["x"], dst="a")
    b = Scale("b", {"num_replicas": 3, "batch_size": 2}, srcs=["a"], dst="b")

    async def main() -> str:
        async with flowrl.open_pipeline(lambda x: b.forward_step(a.forward_step(x)), {"backend": "inprocess"}) as pipe:
            await pipe.run([{"x": np.full(1, float(i))} for i in range(6)])
            console = Console(width=100, record=True, file=open("/dev/null", "w"))
            console.print(stage_table(pipe, "run 0", {"a.forward_step": 2}, 6))
            return console.export_text()

    text = anyio.run(main)
    assert "run 0" in text
    cells = [line.replace("\u2502", " ").split() for line in text.splitlines()]  # the table's vertical bars
    rows = {c[0]: c[1:] for c in cells if c and c[0].startswith(("a.", "b."))}
    # a: 6 ready, 2 replicas take 2 each, 2 wait (peak 2); b gets them as they come
    assert rows == {"a.forward_step": ["4/6", "0/2", "0", "(2)"], "b.forward_step": ["6/6", "0/3", "0", "(0)"]}
