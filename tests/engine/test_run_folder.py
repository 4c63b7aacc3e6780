"""What an engine writes into its run folder when the folder holds what nobody meant for it: a
FIFO or a link where metrics.jsonl or trace.json go is refused when the engine is built, and
one put there later fails the run by name (or is replaced) instead of blocking or writing
through the link. In-process engines."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import pytest
from _resume_models import make_engine

import flowrl
from flowrl._engine.run_folder import METRICS, TRACE

if TYPE_CHECKING:
    from pathlib import Path

MODELS = {"pipeline": {"backend": "inprocess"}, "policy_replicas": 1, "ranks": 1}


def engine_in(run_dir: Path, **config: Any) -> flowrl.Engine:
    engine, _ = make_engine(**MODELS, run_dir=str(run_dir), num_episode=2, **config)
    return engine


def fifo(path: Path) -> None:
    os.mkfifo(path)


def link(path: Path) -> None:
    (path.parent / "elsewhere").write_text("keep")
    path.symlink_to(path.parent / "elsewhere")


def folder(path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize("plant", [fifo, link, folder], ids=["fifo", "link", "folder"])
@pytest.mark.parametrize("name", [METRICS, TRACE])
def test_an_odd_file_where_a_run_file_goes_is_refused_when_the_engine_is_built(tmp_path, plant, name):
    plant(tmp_path / name)
    refused = rf"RunConfig.run_dir=.* cannot hold a run's files: .*{name}: expected a regular file"
    with pytest.raises(flowrl.ConfigError, match=refused):
        engine_in(tmp_path)


def test_a_run_dir_that_is_a_file_is_refused_when_the_engine_is_built(tmp_path):
    (tmp_path / "run").write_text("")
    with pytest.raises(flowrl.ConfigError, match=r"RunConfig.run_dir=.*run' cannot hold a run's files"):
        engine_in(tmp_path / "run")


def test_a_fifo_put_at_metrics_after_the_build_fails_the_run_by_name_instead_of_blocking(tmp_path):
    engine = engine_in(tmp_path)
    fifo(tmp_path / METRICS)  # nobody reads it: a plain open for writing would wait forever
    with pytest.raises(flowrl.FlowError, match=rf"run folder .*: cannot append to {METRICS} "):
        engine.learn()


def test_a_link_put_at_the_trace_after_the_build_is_replaced_not_written_through(tmp_path):
    engine = engine_in(tmp_path)
    link(tmp_path / TRACE)
    engine.learn()
    assert (tmp_path / "elsewhere").read_text() == "keep"
    assert not (tmp_path / TRACE).is_symlink()
    assert json.loads((tmp_path / TRACE).read_text())["traceEvents"]
    assert len((tmp_path / METRICS).read_text().splitlines()) == 2


def episodes_in(path: Path) -> list[int]:
    return [json.loads(line)["episode"] for line in path.read_text().splitlines()]


def test_a_fresh_run_into_a_used_folder_keeps_the_earlier_metrics_aside_and_says_so(tmp_path, caplog):
    """A second and a third fresh run (no checkpoint: both start at episode 0) into one folder:
    each earlier file is kept under the next free name, none over another, and a line names it."""
    caplog.set_level("INFO", logger="flowrl.progress")
    for episodes in (3, 2, 1):
        engine, _ = make_engine(**MODELS, run_dir=str(tmp_path), num_episode=episodes)
        engine.learn()
    assert episodes_in(tmp_path / METRICS) == [0]
    assert episodes_in(tmp_path / f"{METRICS}.1") == [0, 1, 2]
    assert episodes_in(tmp_path / f"{METRICS}.2") == [0, 1]
    said = [r.getMessage() for r in caplog.records if "earlier run" in r.getMessage()]
    assert len(said) == 2
    assert f"{METRICS} held 3 line(s) of episodes >= 0 from an earlier run; that file is kept as {METRICS}.1" in said[0]
    assert said[1].endswith(f"kept as {METRICS}.2")


def test_a_run_that_drops_no_line_keeps_no_copy(tmp_path):
    from flowrl._engine.run_folder import RunDir

    (tmp_path / METRICS).write_text(json.dumps({"episode": 0}) + "\n")
    assert RunDir(tmp_path).drop_from(1, keep=True) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [METRICS]
