"""What a person sees of a run: the live view under a pseudo-terminal (startup, stage and
trainer rows, the last episode's metrics, ETA), one line on Ctrl-C and none of a traceback, the
resume line, and a line per episode when stderr is no terminal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("_live_script.py")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]")
STOPPED = re.compile(r"flowrl: stopped at episode (\d+) of (\d+) \((\d+) done\); (.*)")
WAIT_S = 300  # generous: a loaded 2-core machine starts Ray and torch slowly; a hang still fails


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the scripts start their own
    env.pop("NO_COLOR", None)
    return env


def _spawn(*args: str) -> pexpect.spawn:
    return pexpect.spawn(
        sys.executable,
        list(args),
        cwd=str(ROOT),
        env=_env(),
        encoding="utf-8",
        codec_errors="replace",
        timeout=WAIT_S,
        dimensions=(60, 160),
    )


def _stop(child: pexpect.spawn) -> list[str]:
    """Ctrl-C; the lines the terminal shows from then on, the live view's last frame left out."""
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    text = ANSI.sub("", child.before).replace("\r", "")
    lines = [line.rstrip() for line in text.split("\n")]
    start = next(i for i, line in enumerate(lines) if STOPPED.match(line))
    return [line for line in lines[start:] if line]


def _check_stopped(child: pexpect.spawn, after: list[str]) -> re.Match[str]:
    """One stop line; nothing after it (no traceback); the exit of a process killed by Ctrl-C."""
    assert child.signalstatus == signal.SIGINT or child.exitstatus == 130, (child.exitstatus, after)
    stop = STOPPED.match(after[0])
    assert stop is not None
    assert all("Traceback" not in line and "Error" not in line for line in after), after
    return stop


def test_a_real_example_on_a_terminal_shows_startup_rows_metrics_and_eta_and_stops_in_one_line():
    child = _spawn("examples/ppo_tiny.py", "--backend", "inprocess", "--episodes", "40")
    child.expect(r"flowrl: 8 actors of 6 models ready in [\d.]+ s")
    child.expect("samples trained this episode")  # the trainer rows' header
    child.expect(r"episode \d+/40 · \w+ · [^\n]*episodes/s · ETA ")
    child.expect(r"last episode: ppo_policy policy_loss=-?[\d.]+ [^\n]*; ppo_value value_loss=[\d.]+")
    after = _stop(child)
    stop = _check_stopped(child, after)
    assert after == [after[0]]  # the message alone
    assert stop.group(2) == "40" and int(stop.group(3)) >= 1
    assert stop.group(4) == "nothing to resume (set RunConfig.checkpoint.dir and checkpoint.every to write checkpoints)"


@pytest.mark.slow  # ~18 s; Ctrl-C on Ray is tests/engine/test_interrupt.py's by default
def test_ctrl_c_on_ray_leaves_one_line_naming_the_last_checkpoint(tmp_path):
    child = _spawn(str(SCRIPT), str(tmp_path), "ray")
    child.expect(r"starting actors: \d+/4 ready")  # the startup view: 2 policy replicas, 2 trainer ranks
    child.expect(r"flowrl: 4 actors of 2 models ready in [\d.]+ s")
    child.expect(r"trainer\s*│ \d/2 ")  # its row: ranks busy of 2
    child.expect(r"ETA [^\n]*\n")
    child.expect("last episode: trainer global=8")
    after = _stop(child)
    stop = _check_stopped(child, after)
    assert after == [after[0]]  # (test_interrupt.py checks that no actor is left)
    folder = re.fullmatch(
        r"last checkpoint (\S+); resume with the same command \(RunConfig.checkpoint.resume='auto'\)", stop[4]
    )
    assert folder is not None and Path(folder[1]).parent == tmp_path


def test_a_run_started_again_says_where_it_resumes(tmp_path):
    first = _spawn(str(SCRIPT), str(tmp_path), "inprocess")
    first.expect(r"episode 3/1000: 8 samples")  # the line printed above the live view as it ends
    stop = _check_stopped(first, _stop(first))
    named = re.fullmatch(r"last checkpoint (\S+/episode-(\d+)); resume with the same command .*", stop[4])
    assert named is not None
    # Ctrl-C may stop the checkpoint of the episode just done: the one before is the last whole one
    folder, done = Path(named[1]), int(named[2])
    assert folder.parent == tmp_path and done in (int(stop[3]), int(stop[3]) - 1)

    again = _spawn(str(SCRIPT), str(tmp_path), "inprocess")  # the same command
    again.expect(rf"flowrl: resuming from {re.escape(str(folder))}: episode {done + 1} of 1000, weights version {done}")
    again.expect(rf"episode {done + 1}/1000: 8 samples")  # and it goes on from there
    later = _check_stopped(again, _stop(again))
    assert int(later[3]) > done


def test_not_on_a_terminal_each_episode_is_a_line_on_stderr_and_ctrl_c_one_more(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path), "inprocess"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        seen = [proc.stderr.readline().rstrip("\n") for _ in range(5)]  # startup, ready, three episodes
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read().splitlines()
        proc.wait(timeout=WAIT_S)
    finally:
        proc.kill()
    assert seen[0] == "flowrl: starting 3 actors for 2 models (trainer 1, policy 2) ..."
    assert re.fullmatch(r"flowrl: 3 actors of 2 models ready in [\d.]+ s", seen[1])
    for i, line in enumerate(seen[2:]):
        assert line.startswith(f"flowrl: episode {i + 1}/1000: 8 samples; rollout "), line
        assert line.endswith(f"; trainer global=8 rank=0 world=1 iteration={i}")
    stops = [line for line in rest if line.startswith("flowrl: stopped")]
    assert len(stops) == 1 and "last checkpoint" in stops[0], rest
    assert rest[-1] == stops[0] and all("Traceback" not in line for line in rest)
    assert proc.returncode == -signal.SIGINT


@pytest.mark.slow
def test_the_ppo_example_on_ray_shows_its_trainer_ranks_and_stops_in_one_line():
    child = _spawn("examples/ppo_tiny.py", "--episodes", "40")
    child.expect(r"starting actors: \d+/9 ready")
    child.expect(r"flowrl: 9 actors of 6 models ready in [\d.]+ s")
    child.expect(r"ppo_policy\s*│ \d/2 ")
    child.expect(r"ETA [^\n]*\n")
    after = _stop(child)
    _check_stopped(child, after)
    assert len(after) == 1
