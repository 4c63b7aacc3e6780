"""`flowrl trace`: the summary of a run's timeline and its chart, and what is missing."""

from __future__ import annotations

import numpy as np

import flowrl
from flowrl.testing import CountingTrainer, Scale

CPU = {"cpus_per_replica": 0.1}


def test_flowrl_trace_prints_a_summary_and_draws_the_chart(ray_cluster, tmp_path, capsys):
    from flowrl._tools.cli import main

    policy = Scale("policy", {"num_replicas": 2, "batch_size": 2, **CPU}, srcs=["x"], dst="y", sleep_s=0.002)
    trainer = CountingTrainer("trainer", {"num_replicas": 1, **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        config={"sample_per_episode": 8, "num_episode": 2, "run_dir": str(tmp_path)},
    )
    engine.set_dataset([{"x": np.full(1, float(i))} for i in range(16)])
    stats = engine.learn()
    assert main(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[3:] if line.strip() and not line.startswith("chart")}
    assert set(rows) == {"engine", "policy", "trainer"}
    assert rows["policy"][1:4] == ["2", str(stats.rollout["policy.forward_step"].calls), "16"]  # lanes, spans, samples
    assert rows["trainer"][1:4] == ["1", "2", "16"] and rows["engine"][2] == "4"  # 2 x (rollout, train)
    png = tmp_path / "timeline.png"
    assert out[-1] == f"chart: {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flowrl_trace_names_what_is_missing(tmp_path, capsys):
    from flowrl._tools.cli import main

    assert main(["trace", str(tmp_path)]) == 2
    assert f"no trace at {tmp_path / 'trace.json'}" in capsys.readouterr().err
    (tmp_path / "trace.json").write_text('{"not": "a trace"}')
    assert main(["trace", str(tmp_path), "--no-png"]) == 2
    assert "is not a flowrl trace: Object missing required field `traceEvents`" in capsys.readouterr().err


def test_a_chart_of_more_rows_than_a_png_holds_is_refused_in_one_line_and_the_summary_still_prints(tmp_path, capsys):
    from flowrl._core.trace import Span, chrome_trace, write_json
    from flowrl._tools.cli import main
    from flowrl._tools.timeline_view import MAX_CHART_ROWS

    spans = [Span(group="policy", lane=i, name="forward_step", start=0.0, end=1.0) for i in range(MAX_CHART_ROWS + 1)]
    write_json(tmp_path / "trace.json", chrome_trace(spans))
    assert main(["trace", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert f"{MAX_CHART_ROWS + 1} rows" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "policy" in captured.out  # the summary came first
    assert not (tmp_path / "timeline.png").exists()
    assert main(["trace", str(tmp_path), "--no-png"]) == 0
