"""Ctrl-C at any point of a `flowrl run`: start-up, rollout, training, checkpoint, weight sync.

The run's own models send SIGINT to the run's process group (as a terminal does) from inside
the phase under test, at a call chosen by a seeded draw, so the interrupt lands where the test
says and not where a timer happens to fall. Each time: exit status 130, no traceback, the stop
line, and the printed command resumes into the same folder and finishes every episode once.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pathlib import Path

EPISODES = 4
RUN_FILE = f"""\
flow: anywhere_flow:rollout
dataset: anywhere_flow:items
train: [trainer]
sync: [[trainer, gen]]
models:
  gen: {{class: anywhere_flow:Gen, batch_size: 4}}
  trainer: {{class: anywhere_flow:Trainer}}
run: {{sample_per_episode: 4, num_episode: {EPISODES}, checkpoint: {{every: 1}}, progress: log}}
"""

# PHASE and CALL (environment) say where the interrupt goes: the CALL-th call of that phase. The
# run's process group is the child's own (started in a new session), read once by the driver.
MODULE = """\
import os, signal
import numpy as np
import flowrl
from flowrl.testing import CountingTrainer

PHASE, CALL = os.environ.get("PHASE", ""), int(os.environ.get("CALL", "0"))
GROUP = int(os.environ["CTRL_C_GROUP"])
calls = {}

def maybe_interrupt(phase):
    calls[phase] = calls.get(phase, 0) + 1
    if phase == PHASE and calls[phase] == CALL:
        os.killpg(GROUP, signal.SIGINT)

class Gen(flowrl.Model):
    def setup(self):
        maybe_interrupt("start-up")

    def forward_step(self, batch, iteration):
        maybe_interrupt("rollout")
        return {"y": np.asarray(batch["x"]) * 2}

    def set_weights(self, weights):
        maybe_interrupt("sync")

class Trainer(CountingTrainer):
    def train_step(self, batch, iteration):
        maybe_interrupt("training")
        return super().train_step(batch, iteration)

    def checkpoint_state(self):
        maybe_interrupt("checkpoint")
        return super().checkpoint_state()

def rollout(prompts, *, gen):
    return gen.forward_step(prompts)

def items():
    return [{"x": np.full(1, float(i))} for i in range(8)]
"""

# `flowrl` as its console script runs it, with Python's Ctrl-C handler put back (a test runner
# started in the background hands its children SIGINT ignored), its process group made known.
CHILD = (
    "import os, runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "os.environ['CTRL_C_GROUP'] = str(os.getpgid(0)); "
    "sys.argv = ['flowrl', *sys.argv[1:]]; runpy.run_module('flowrl', run_name='__main__')"
)
PHASES = ["start-up", "rollout", "training", "checkpoint", "sync"]


def flowrl_run(folder: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", CHILD, *args]
    return subprocess.run(
        command, cwd=folder, start_new_session=True, capture_output=True, text=True, env=env, timeout=300
    )


def interrupt_and_resume(folder: Path, phase: str, call: int, backend: str) -> None:
    (folder / "anywhere_flow.py").write_text(MODULE)
    (folder / "run.yaml").write_text(RUN_FILE)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"PHASE": phase, "CALL": str(call)}
    first = flowrl_run(folder, ["run", "run.yaml", "--set", f"run.pipeline.backend={backend}"], env)
    where = f"Ctrl-C at {phase} call {call}"
    assert first.returncode == 130, (where, first.stdout, first.stderr[-3000:])
    assert "Traceback" not in first.stderr, (where, first.stderr[-3000:])
    (run_dir,) = (folder / "runs").iterdir()
    resume = first.stdout.splitlines()[-1]
    assert resume.startswith("resume into this folder with: flowrl run run.yaml --run-dir"), (where, first.stdout)
    command = shlex.split(resume.split(": ", 1)[1])[1:]
    again = flowrl_run(folder, command, env | {"PHASE": ""})
    assert again.returncode == 0, (where, again.stderr[-3000:])
    episodes = [json.loads(line)["episode"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(episodes)) == episodes and len(episodes) == EPISODES, (where, episodes)


# start-up and checkpoint in the default run; the other phases, each a few seconds more, in the slow set
FAST = ("start-up", "checkpoint")


@pytest.mark.parametrize("phase", [p if p in FAST else pytest.param(p, marks=pytest.mark.slow) for p in PHASES])
def test_ctrl_c_anywhere_exits_130_and_the_run_resumes_to_its_end(tmp_path, phase):
    # start-up happens once; the other phases come back each episode: a seeded draw of which call
    call = 1 if phase == "start-up" else random.Random(f"ctrl-c {phase}").randint(1, EPISODES - 1)
    interrupt_and_resume(tmp_path, phase, call, "inprocess")


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["rollout", "checkpoint"])
def test_ctrl_c_anywhere_on_ray(tmp_path, phase):
    interrupt_and_resume(tmp_path, phase, 2, "ray")
