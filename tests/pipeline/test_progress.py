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
