"""Progress views: an engine's and a pipeline's log lines, live view or nothing, and the live
table of stages."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest

import flowrl
from flowrl.testing import CountingTrainer, Scale


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
    said = [r.getMessage() for r in caplog.records]
    assert [r.name for r in caplog.records] == ["flowrl.progress"] * 4
    assert said[0] == "starting 3 actors for 2 models (t 1, policy 2) ..."
    assert said[1].startswith("3 actors of 2 models ready in ")
    assert [line.split(":")[0] for line in said[2:]] == ["episode 1/2", "episode 2/2"]
    assert capsys.readouterr() == ("", "")  # the application's logging (pytest's) has them
    _engine("live").learn()
    err = capsys.readouterr().err
    assert "episode 1/2: 4 samples" in err and "episode 2/2: 4 samples" in err
    caplog.clear()
    _engine("auto").learn()  # not a terminal: log lines at INFO, which pytest's logging level hides
    assert capsys.readouterr() == ("", "") and len(caplog.records) == 0
    with pytest.raises(flowrl.ConfigError, match=r"RunConfig.progress must be one of \['auto', 'live', 'log', 'off'\]"):
        _engine("verbose")


def _said(code: str) -> str:
    """What ``say`` leaves on stderr in a fresh interpreter (pytest configures logging here)."""
    import subprocess
    import sys

    prog = f"import logging\nfrom flowrl._pipeline.progress import say\n{code}\nsay('episode 1/2: 4 samples')"
    return subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, check=True).stderr


def test_progress_lines_reach_stderr_unless_the_application_configured_logging():
    assert _said("") == "flowrl: episode 1/2: 4 samples\n"  # nothing configured: flowrl prints it
    assert _said("logging.basicConfig(level=logging.WARNING)") == ""  # configured: its level rules
    assert _said("logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')") == (
        "flowrl.progress episode 1/2: 4 samples\n"
    )
    assert _said("logging.getLogger('flowrl.progress').setLevel(logging.WARNING)") == ""  # silenced by hand


def test_the_title_gives_the_episode_phase_pace_and_eta():
    from flowrl._engine.engine_view import pace, title
    from flowrl._pipeline.progress import duration

    assert pace(3, 3, 30, 10.0) == (None, None)  # no episode of this learn() done yet
    assert pace(13, 3, 30, 20.0) == (0.5, 34.0)  # 10 episodes in 20 s, 17 left
    assert title(0, 0, 30, 4.2, "rollout") == "episode 1/30 · rollout · 4 s"
    assert title(13, 3, 30, 20.0, "train") == "episode 14/30 · train · 20 s · 0.5 episodes/s · ETA 34 s"
    assert title(30, 0, 30, 90.0, "eval").startswith("episode 30/30 · eval · 1 min 30 s")
    assert [duration(s) for s in (0.4, 59.6, 61, 3600, 7325)] == [
        "0 s",
        "1 min 00 s",
        "1 min 01 s",
        "1 h 00 min",
        "2 h 02 min",
    ]


def _text(renderable: object) -> str:
    from rich.console import Console

    console = Console(width=120, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _rows(text: str) -> dict[str, list[str]]:
    cells = [line.replace("\u2502", " ").split() for line in text.splitlines()]  # the tables' vertical bars
    return {c[0]: c[1:] for c in cells if len(c) > 1}


def test_the_trainer_rows_show_ranks_busy_and_samples_trained_this_episode():
    from flowrl._engine.engine_view import trainer_table

    rows = {"ppo_policy": (2, 2, 96), "ppo_value": (0, 1, 40)}
    text = _text(trainer_table(rows, {"ppo_policy": 64, "ppo_value": 40}))
    assert _rows(text)["ppo_policy"] == ["2/2", "32"] and _rows(text)["ppo_value"] == ["0/1", "0"]


def test_the_startup_view_counts_actors_ready_per_model_and_placement_groups():
    from flowrl._backends.specs import ActorCounts, Bundle, ReplicaSpec
    from flowrl._pipeline.progress import startup_line, startup_table

    policy, trainer = Scale("policy", {}, srcs=["x"], dst="y"), CountingTrainer("t")
    counts = ActorCounts()
    bundle = Bundle("gpus", 0, 2, 1.0)
    counts.expect(
        [ReplicaSpec(trainer, 0, 1, 0), ReplicaSpec(policy, 0, 1, 1, bundle), ReplicaSpec(policy, 1, 1, 1, bundle)]
    )
    assert startup_line(counts) == "starting 3 actors for 2 models (t 1, policy 2, 1 placement group) ..."
    counts.started("policy")
    text = _text(startup_table(counts, 12.3))
    assert "starting actors: 1/3 ready · 12 s · placement groups reserved 0/1" in text
    assert _rows(text)["t"] == ["0/1"] and _rows(text)["policy"] == ["1/2"]
    counts.reserved.add("gpus")
    assert "placement groups reserved 1/1" in _text(startup_table(counts, 13.0))


def test_the_stop_and_resume_lines_say_where_and_how_to_go_on():
    from pathlib import Path

    from flowrl._engine.checkpoints import resume_line
    from flowrl._engine.engine_view import stopped_line

    assert stopped_line(12, 30, Path("runs/x/episode-000010"), "runs/x") == (
        "flowrl: stopped at episode 13 of 30 (12 done); last checkpoint runs/x/episode-000010; "
        "resume with the same command (RunConfig.checkpoint.resume='auto')"
    )
    assert stopped_line(12, 30, Path("runs/x/episode-000010"), "runs/x", "never").endswith(
        "last checkpoint runs/x/episode-000010; resume with RunConfig.checkpoint.resume='auto' (this run has 'never')"
    )
    assert stopped_line(0, 30, None, "runs/x").endswith("no checkpoint written yet in runs/x, so nothing to resume")
    assert stopped_line(3, 30, None, None).endswith(
        "nothing to resume (set RunConfig.checkpoint.dir and checkpoint.every to write checkpoints)"
    )
    folder = Path("runs/x/episode-000020")
    assert resume_line(folder, 20, 30, {"policy": 20}) == (
        "resuming from runs/x/episode-000020: episode 21 of 30, weights version 20"
    )
    assert resume_line(folder, 20, 30, {"policy": 20, "value": 10}).endswith("weights versions policy 20, value 10")
    assert resume_line(folder, 20, 30, {}) == "resuming from runs/x/episode-000020: episode 21 of 30"


@pytest.mark.parametrize("progress", ["log", "live", "off"])
def test_a_pipeline_stream_logs_a_line_per_run_or_draws_or_stays_quiet(caplog, capsys, progress):
    double = Scale("double", {"num_replicas": 2, "batch_size": 3}, srcs=["x"], dst="y", sleep_s=0.001)
    with caplog.at_level(logging.INFO, logger="flowrl"):
        with flowrl.Pipeline(lambda x: double.forward_step(x), {"backend": "inprocess", "progress": progress}) as pipe:
            for _ in range(2):
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
            console = Console(width=100, record=True, file=io.StringIO())
            console.print(stage_table(pipe, "run 0", {"a.forward_step": 2}, 6))
            return console.export_text()

    text = anyio.run(main)
    assert "run 0" in text
    cells = [line.replace("\u2502", " ").split() for line in text.splitlines()]  # the table's vertical bars
    rows = {c[0]: c[1:] for c in cells if c and c[0].startswith(("a.", "b."))}
    # a: 6 ready, 2 replicas take 2 each, 2 wait (peak 2); b gets them as they come
    assert rows == {"a.forward_step": ["4/6", "0/2", "0", "(2)"], "b.forward_step": ["6/6", "0/3", "0", "(0)"]}


def test_the_interrupt_raised_after_the_stop_line_gets_no_traceback_and_other_errors_still_do(capsys, monkeypatch):
    import sys

    from flowrl._pipeline import progress

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
    monkeypatch.setattr(progress, "_previous_hook", [])
    err = progress.interrupted("flowrl: stopped at episode 2 of 3 (1 done); nothing to resume")
    assert type(err) is KeyboardInterrupt  # Python exits by SIGINT only for this very type
    assert capsys.readouterr().err == "flowrl: stopped at episode 2 of 3 (1 done); nothing to resume\n"
    other = ValueError("a real failure")
    sys.excepthook(KeyboardInterrupt, err, None)
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)  # one flowrl did not tell about
    sys.excepthook(ValueError, other, None)
    assert len(seen) == 2 and seen[1] is other and seen[0] is not err
    progress.interrupted("again")  # installed once: the hook before ours is kept, not ours
    assert progress._previous_hook[0] is not progress._quiet_hook
