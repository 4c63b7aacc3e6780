"""Ctrl-C in `flowrl run`: exit status 130 and no traceback, the run folder's files named on the
way out. The interrupt goes to the child's whole process group, as a terminal sends it (Ray's
processes started by the run get it too), once the engine's first episode line is out: the
test waits on the child's output, not on a timer."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pathlib import Path

RUN_FILE = """\
flow: interrupt_flow:rollout
dataset: interrupt_flow:items
train: [trainer]
sync: [[trainer, gen]]
models:
  gen: {class: flowrl.testing:Scale, batch_size: 2, args: {srcs: [x], dst: y, sleep_s: 0.02}}
  trainer: {class: flowrl.testing:CountingTrainer}
run: {sample_per_episode: 4, num_episode: 100000, progress: log}
"""

# The command as `flowrl` runs it (flowrl/__main__.py), with Python's Ctrl-C handler put back: a
# test runner started in the background by a shell hands its children SIGINT ignored.
CHILD = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = ['flowrl', *sys.argv[1:]]; runpy.run_module('flowrl', run_name='__main__')"
)


def start_run(folder: Path, *args: str) -> subprocess.Popen[str]:
    (folder / "interrupt_flow.py").write_text(
        "import numpy as np\n"
        "def rollout(prompts, *, gen):\n    return gen.forward_step(prompts)\n"
        "def items():\n    return [{'x': np.full(1, float(i))} for i in range(8)]\n"
    )
    (folder / "run.yaml").write_text(RUN_FILE)
    command = [sys.executable, "-c", CHILD, "run", "run.yaml", *args]
    return subprocess.Popen(  # in a process group of its own, as a terminal's foreground job
        command, cwd=folder, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def interrupt_after_the_first_episode(run: subprocess.Popen[str]) -> tuple[str, str]:
    """Read the child's log until an episode line, send SIGINT, then everything it says after."""
    assert run.stderr is not None
    seen = []
    for line in run.stderr:  # a hang here is pytest-timeout's
        seen.append(line)
        if re.search(r"\bepisode \d+/\d+", line):
            break
    else:
        pytest.fail(f"the run ended before an episode line: {''.join(seen)}")
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=300)
    return out, "".join(seen) + err


# ray: about 15 s (50 s on a loaded machine), slow: Ctrl-C on Ray is tests/engine/test_interrupt.py's
@pytest.mark.parametrize("backend", ["inprocess", pytest.param("ray", marks=pytest.mark.slow)])
def test_ctrl_c_exits_130_without_a_traceback(tmp_path, backend):
    run = start_run(tmp_path, "--set", f"run.pipeline.backend={backend}")
    out, err = interrupt_after_the_first_episode(run)
    assert run.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    (folder,) = (tmp_path / "runs").iterdir()
    lines = out.splitlines()
    assert lines[0] == f"run folder: runs/{folder.name}"
    # the way out names what the run wrote, and the episodes done are in it
    assert lines[-1].startswith(f"metrics: runs/{folder.name}/metrics.jsonl"), out
    assert (folder / "metrics.jsonl").read_text().count("\n") >= 1
    assert "done:" not in out


def test_ctrl_c_without_a_run_folder_says_nothing_of_one(tmp_path):
    run = start_run(tmp_path, "--set", "run.pipeline.backend=inprocess", "--no-run-dir")
    out, err = interrupt_after_the_first_episode(run)
    assert run.returncode == 130 and "Traceback" not in err, err
    assert out == "" and not (tmp_path / "runs").exists()


def test_ctrl_c_while_the_engine_is_built_exits_130_and_leaves_no_folder(tmp_path, monkeypatch, capsys):
    import flowrl._tools.run_file as run_file
    from flowrl._tools.cli import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    (tmp_path / "run.yaml").write_text(RUN_FILE)
    monkeypatch.setattr(run_file, "build_engine", interrupted)
    monkeypatch.chdir(tmp_path)
    assert main(["run", "run.yaml"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "flowrl run: stopped while the engine was being built; nothing ran\n"
    assert captured.out == "" and not (tmp_path / "runs").exists()


GATED_FILE = """\
flow: gated_flow:rollout
dataset: gated_flow:items
train: [trainer]
models:
  gen: {class: gated_flow:Gate, batch_size: 4}
  trainer: {class: flowrl.testing:CountingTrainer}
run: {sample_per_episode: 4, num_episode: 4, checkpoint: {every: 1}, progress: log, pipeline: {backend: inprocess}}
"""

# Holds the third episode's rollout while a file named "hold" exists, having said so in "held":
# the test interrupts a run known to be inside episode 3, with two checkpoints written.
GATED_MODULE = """\
import os, time
import numpy as np
import flowrl

class Gate(flowrl.Model):
    def setup(self):
        self.calls = 0

    def forward_step(self, batch, iteration):
        self.calls += 1
        if self.calls == 3 and os.path.exists("hold"):
            open("held", "w").close()
            while os.path.exists("hold"):  # the test removes it once it has sent Ctrl-C
                time.sleep(0.01)
        return {"y": np.asarray(batch["x"]) * 2}

def rollout(prompts, *, gen):
    return gen.forward_step(prompts)

def items():
    return [{"x": np.full(1, float(i))} for i in range(8)]
"""


def test_the_printed_command_resumes_into_the_same_folder(tmp_path):
    (tmp_path / "gated_flow.py").write_text(GATED_MODULE)
    (tmp_path / "run.yaml").write_text(GATED_FILE)
    (tmp_path / "hold").touch()
    command = [sys.executable, "-c", CHILD, "run", "run.yaml", "--set", "run.shuffle=false"]
    run = subprocess.Popen(
        command, cwd=tmp_path, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert run.stdout is not None
    first = run.stdout.readline()  # "run folder: ...", printed before the run starts
    while not (tmp_path / "held").exists():  # the child is inside episode 3 (a hang is pytest-timeout's)
        assert run.poll() is None, run.communicate()
        time.sleep(0.01)
    os.killpg(run.pid, signal.SIGINT)
    (tmp_path / "hold").unlink()
    out, err = run.communicate(timeout=300)
    assert run.returncode == 130, (out, err)
    (folder,) = (tmp_path / "runs").iterdir()
    assert first == f"run folder: runs/{folder.name}\n"
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()), "checkpoints go in the run folder"
    resume = out.splitlines()[-1]
    expected = f"flowrl run run.yaml --run-dir runs/{folder.name} --set run.shuffle=false"
    assert resume == f"resume into this folder with: {expected}", out
    assert "resume into this folder with the command printed below" in err, err  # the engine's stop line
    again = subprocess.run(
        [sys.executable, "-c", CHILD, *shlex.split(expected)[1:]], cwd=tmp_path, capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    assert list((tmp_path / "runs").iterdir()) == [folder]  # no second folder
    episodes = [json.loads(line)["episode"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert episodes == sorted(set(episodes)) and len(episodes) == 4, episodes  # every episode, once
