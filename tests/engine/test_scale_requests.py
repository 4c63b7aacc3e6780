"""`flowrl scale` requests are bound to the run under way: the live marker a run keeps in its run
folder, the requests it refuses to apply (left before it began, for another run, not a regular
file), and the counts the command accepts. The engine runs in-process here; the Ray path of a
request is in test_engine_resize.py."""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import pytest
from _resume_models import make_engine

import flowrl
from flowrl._engine.elastic import DONE, FAILED, MAX_REPLICAS, REQUEST, Elasticity, Inbox, request_scale
from flowrl._engine.run_folder import LIVE, LiveRun, find_live_run, live_run
from flowrl._tools.cli import main

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    from anyio.streams.memory import MemoryObjectReceiveStream

MODELS = {"pipeline": {"backend": "inprocess"}, "policy_replicas": 1, "ranks": 1}
SCALE = "flowrl scale: ConfigError: "  # how the command prints a mistake (one line, exit 2)


def inprocess_engine(run_dir: Path, **config: Any) -> flowrl.Engine:
    engine, _ = make_engine(**MODELS, run_dir=str(run_dir), **config)
    return engine


def marker(folder: Path, **fields: Any) -> None:
    run = {"run_id": "ab" * 16, "pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), **fields}
    (folder / LIVE).write_bytes(msgspec.json.encode(run))


@pytest.fixture
def polls(monkeypatch) -> MemoryObjectReceiveStream[str]:
    """An item after each step of the watcher's polls: what its inbox took (in the worker thread),
    and each request applied (or refused)."""
    send, receive = anyio.create_memory_object_stream[str](1000)
    take, apply = Inbox.take, Elasticity._apply

    def took(self: Inbox) -> bytes | None:
        got = take(self)
        anyio.from_thread.run_sync(send.send_nowait, "took")
        return got

    async def applied(self: Elasticity, *args: Any) -> None:
        await apply(self, *args)
        send.send_nowait("applied")

    monkeypatch.setattr(Inbox, "take", took)
    monkeypatch.setattr(Elasticity, "_apply", applied)
    return receive


async def until(polls: MemoryObjectReceiveStream[str], condition: Callable[[], bool], what: str) -> None:
    """Wait until a step of the watcher makes ``condition`` true (it polls every 0.5 s): 30 s at most."""
    with anyio.fail_after(30):
        while not condition():
            await polls.receive()
    assert condition(), what


def served(stats: flowrl.EngineStats) -> set[int]:
    return {r.replica for r in stats.rollout.stages["policy.forward_step"].replicas if r.samples}


# ---- the live marker ----


def test_the_marker_is_there_while_learn_runs_and_gone_after(tmp_path):
    engine = inprocess_engine(tmp_path, num_episode=2)
    seen: list[LiveRun] = []
    relay = engine._learning.relay_fn

    def look(episodes: list[flowrl.EpisodeBuffer]) -> list[flowrl.Sample]:
        seen.append(find_live_run(tmp_path))  # from inside the run: raises if there is none
        return relay(episodes)

    engine.set_relay_sample_fn(look)
    engine.learn()
    assert len(seen) == 2 and seen[0] == seen[1]  # one marker for the whole learn()
    assert seen[0].pid == os.getpid() and len(seen[0].run_id) == 32
    assert seen[0].models == ["policy"]  # what flowrl scale may resize: the rollout's models, not the trainer
    assert not (tmp_path / LIVE).exists()


def test_the_marker_is_gone_after_a_failing_run(tmp_path):
    engine = inprocess_engine(tmp_path)
    seen: list[LiveRun] = []

    def fail(episodes: list[flowrl.EpisodeBuffer]) -> list[flowrl.Sample]:
        seen.append(find_live_run(tmp_path))
        raise RuntimeError("the relay function fails")

    engine.set_relay_sample_fn(fail)
    with pytest.raises(RuntimeError, match="the relay function fails"):
        engine.learn()
    assert len(seen) == 1 and not (tmp_path / LIVE).exists()
    with pytest.raises(flowrl.ConfigError, match=f"no live run in {tmp_path}: no live.json"):
        find_live_run(tmp_path)


def test_each_learn_call_is_a_run_of_its_own(tmp_path):
    engine = inprocess_engine(tmp_path, num_episode=1)
    seen: list[str] = []
    relay = engine._learning.relay_fn

    def look(episodes: list[flowrl.EpisodeBuffer]) -> list[flowrl.Sample]:
        seen.append(find_live_run(tmp_path).run_id)
        return relay(episodes)

    engine.set_relay_sample_fn(look)
    with engine:
        engine.learn()
        assert not (tmp_path / LIVE).exists()  # between learn() calls no run is live
        engine.learn()
    assert len(seen) == 2 and seen[0] != seen[1]


def test_a_run_does_not_remove_a_marker_another_run_wrote_over_its_own(tmp_path):
    with live_run(tmp_path, ["policy"]):
        marker(tmp_path, run_id="cd" * 16)  # a second run in the same folder
    assert find_live_run(tmp_path).run_id == "cd" * 16


# ---- requests left for no run ----


def test_flowrl_scale_exits_2_when_no_run_is_live(tmp_path, capsys):
    assert main(["scale", str(tmp_path), "policy=2"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"flowrl scale: ConfigError: no live run in {tmp_path}: no live.json") and err.count("\n") == 1
    )
    assert not (tmp_path / REQUEST).exists()


def dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


@pytest.mark.parametrize(
    "plant, message",
    [
        (lambda d: marker(d, pid=dead_pid()), "names process"),
        (lambda d: (d / LIVE).write_bytes(b"{not json"), "is not a run marker"),
        (lambda d: marker(d, run_id="../../etc"), "is not a run marker"),
        (lambda d: (d / LIVE).write_bytes(b" " * 70_000), "of at most 65536 bytes, it has 70000"),
        (lambda d: marker(d, pid=2**40), "is not a run marker"),  # os.kill would raise OverflowError
        (lambda d: os.mkfifo(d / LIVE), "expected a regular file, found a FIFO"),  # must not block the command
        (lambda d: (d / LIVE).symlink_to("/dev/zero"), "expected a regular file, found a symbolic link"),
    ],
    ids=["dead-pid", "not-json", "bad-run-id", "oversized", "pid-past-pid_t", "fifo", "symlink"],
)
def test_flowrl_scale_exits_2_on_a_marker_of_no_live_run(tmp_path, capsys, plant, message):
    plant(tmp_path)
    assert main(["scale", str(tmp_path), "policy=2"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"flowrl scale: ConfigError: no live run in {tmp_path}")
        and message in err
        and err.count("\n") == 1
    )
    assert not (tmp_path / REQUEST).exists()


def test_a_marker_from_another_host_is_trusted(tmp_path, capsys):
    marker(tmp_path, pid=dead_pid(), host="another-node")  # its pid cannot be checked from here
    assert main(["scale", str(tmp_path), "policy=2"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / REQUEST).read_bytes()) == {"run": "ab" * 16, "sizes": {"policy": 2}}


def test_a_request_planted_before_the_engine_starts_is_removed_unapplied(tmp_path, caplog):
    (tmp_path / REQUEST).write_bytes(msgspec.json.encode({"run": "ab" * 16, "sizes": {"policy": 2}}))
    engine = inprocess_engine(tmp_path, num_episode=3)
    relay = engine._learning.relay_fn
    left: list[bool] = []

    def look(episodes: list[flowrl.EpisodeBuffer]) -> list[flowrl.Sample]:
        left.append((tmp_path / REQUEST).exists())
        return relay(episodes)

    engine.set_relay_sample_fn(look)
    stats = engine.learn()
    assert left == [False, False, False]  # gone before the first episode's rollout ended
    assert stats.rollout.serving == {"policy": 1} and served(stats) == {0}
    assert not (tmp_path / DONE).exists() and not (tmp_path / FAILED).exists()
    assert f"removed {tmp_path / REQUEST} unread: it was left before this run began" in caplog.text
    assert "ignored a scale request for run" not in caplog.text  # removed at the start, not read by a poll


# ---- requests while a run is live ----


async def test_a_request_for_another_run_is_ignored_and_one_for_this_run_applied(tmp_path, caplog, polls):
    engine = inprocess_engine(tmp_path)
    async with engine:
        elasticity = engine._session.elasticity
        async with anyio.create_task_group() as tg:
            run = await tg.start(elasticity.watch_requests, tmp_path)
            other = {"run": "ef" * 16, "sizes": {"policy": 3}}
            (tmp_path / REQUEST).write_bytes(msgspec.json.encode(other))
            await until(polls, lambda: not (tmp_path / REQUEST).exists(), "the watcher takes the request")
            assert engine._session.deployment.rollout.serving("policy") == [0]
            request_scale(tmp_path, {"policy": 2})
            await until(polls, (tmp_path / DONE).exists, "the watcher applies the request")
            tg.cancel_scope.cancel()
        assert engine._session.deployment.rollout.serving("policy") == [0, 1]
    done = json.loads((tmp_path / DONE).read_bytes())
    assert done == {"run": run.run_id, "requested": {"policy": 2}, "changed": {"policy": [1]}}
    assert f"ignored a scale request for run {'ef' * 16}: this run is {run.run_id}" in caplog.text
    assert not (tmp_path / FAILED).exists() and not (tmp_path / LIVE).exists()


class Shared(queue.Queue[Any]):
    """A queue each in-process replica's copy of the model shares (it deep-copies the model)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> Shared:
        return self


async def test_flowrl_scale_resizes_a_learn_under_way(tmp_path, capsys, polls):
    gate = Shared()  # a permit per policy shard: the run waits for the test
    report = Shared()  # (replica, samples) after each policy shard
    engine, _ = make_engine(
        pipeline={"backend": "inprocess", "inprocess_threads": True},  # the gate blocks a worker thread
        policy_replicas=1,
        ranks=1,
        num_episode=2,
        run_dir=str(tmp_path),
        gate=gate,
        report=report,
    )
    gate.put(True)
    try:
        async with anyio.create_task_group() as tg:
            result: list[flowrl.EngineStats] = []
            tg.start_soon(lambda: _learn(engine, result))
            await anyio.to_thread.run_sync(lambda: report.get(timeout=60))  # a shard ran: the run is live
            assert main(["scale", str(tmp_path), "policy=2"]) == 0, capsys.readouterr().err
            await until(polls, (tmp_path / DONE).exists, "the run applies the request")
            for _ in range(16):  # the rest of the run: a shard holds >= 1 of its 16 samples
                gate.put(True)
    finally:
        for _ in range(16):  # a failed test leaves no replica thread waiting
            gate.put(True)
    (stats,) = result
    assert stats.rollout.serving == {"policy": 2} and len(stats.episodes) == 2
    assert json.loads((tmp_path / DONE).read_bytes())["changed"] == {"policy": [1]}
    assert not (tmp_path / LIVE).exists()


async def _learn(engine: flowrl.Engine, result: list[flowrl.EngineStats]) -> None:
    result.append(await engine.alearn())


def plant_fifo(path: Path) -> None:
    os.mkfifo(path)


def plant_folder(path: Path) -> None:
    path.mkdir()


def plant_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def plant_large(path: Path) -> None:
    path.write_bytes(b" " * (64 * 1024 + 1))


async def test_what_is_not_a_request_file_neither_blocks_nor_ends_the_run(tmp_path, caplog, polls):
    engine = inprocess_engine(tmp_path, num_episode=2)
    path = tmp_path / REQUEST
    async with engine:
        async with anyio.create_task_group() as tg:
            await tg.start(engine._session.elasticity.watch_requests, tmp_path)
            for plant in (plant_fifo, plant_folder, plant_zero, plant_large):
                plant(path)
                await until(polls, lambda: not os.path.lexists(path), f"the watcher removes what {plant.__name__} left")
            request_scale(tmp_path, {"policy": 2})  # and it still serves requests
            await until(polls, (tmp_path / DONE).exists, "the watcher applies the request")
            tg.cancel_scope.cancel()
        assert await engine.aresize("policy", 1) == [1]  # the resize API still works
        stats = await engine.alearn()  # and a run finishes
    assert len(stats.episodes) == 2 and stats.rollout.serving == {"policy": 1}
    for kind in ("a FIFO", "a folder", "a symbolic link", "at most 65536 bytes"):
        assert f"removed {path}, not a scale request: {path}: expected a regular file" in caplog.text
        assert kind in caplog.text


def test_a_folder_that_cannot_be_removed_is_left_with_one_warning(tmp_path, caplog):
    (tmp_path / REQUEST).mkdir()
    (tmp_path / REQUEST / "keep").write_text("not ours to delete")
    inbox = Inbox(tmp_path, "ab" * 16)
    with caplog.at_level(logging.WARNING, logger="flowrl"):
        assert [inbox.take() for _ in range(3)] == [None, None, None]
    assert (tmp_path / REQUEST / "keep").read_text() == "not ours to delete"
    assert [r.getMessage() for r in caplog.records].count(
        f"ignoring {tmp_path / REQUEST}, not a scale request ({tmp_path / REQUEST}: expected a regular file, "
        "found a folder); it cannot be removed: remove it"
    ) == 1


def test_the_inbox_claims_a_request_and_removes_it(tmp_path):
    inbox = Inbox(tmp_path, "ab" * 16)
    assert inbox.take() is None
    (tmp_path / REQUEST).write_bytes(b'{"run": "x", "sizes": {}}')
    assert inbox.take() == b'{"run": "x", "sizes": {}}'
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the request nor its claimed copy


async def test_a_malformed_request_is_written_back_as_failed(tmp_path, polls):
    engine = inprocess_engine(tmp_path)
    async with engine:
        async with anyio.create_task_group() as tg:
            await tg.start(engine._session.elasticity.watch_requests, tmp_path)
            (tmp_path / REQUEST).write_bytes(b'{"policy": 2}')  # the format before requests named their run
            await until(polls, (tmp_path / FAILED).exists, "the watcher writes the failure back")
            tg.cancel_scope.cancel()
    assert (tmp_path / FAILED).read_text() == (
        f'ConfigError: {tmp_path / REQUEST}: expected {{"run": RUN_ID, "sizes": {{MODEL: N}}}} with N from 1 to '
        "10,000; Object contains unknown field `policy`\n"
    )


# ---- the counts `flowrl scale` takes ----


@pytest.mark.parametrize(
    "items, bad",
    [
        (["policy=0"], "policy=0"),
        (["policy=-1"], "policy=-1"),
        (["policy=+3"], "policy=+3"),
        (["policy=\u0663"], "policy=\u0663"),  # Arabic-Indic three: str.isdigit() says yes
        (["policy=\u00b2"], "policy=\u00b2"),  # superscript two
        (["policy=\uff13"], "policy=\uff13"),  # fullwidth three
        (["policy=3 "], "policy=3 "),
        (["policy=3\n"], "policy=3\n"),
        (["policy=3.0"], "policy=3.0"),
        ([f"policy={MAX_REPLICAS + 1}"], f"policy={MAX_REPLICAS + 1}"),
        (["policy=" + "9" * 5000], "policy=" + "9" * 5000),  # past int()'s digit limit
        (["policy="], "policy="),
        (["policy"], "policy"),
        (["=3"], "=3"),
        (["policy=2", "reward=x"], "reward=x"),
    ],
)
def test_flowrl_scale_refuses_what_is_not_a_count(tmp_path, capsys, items, bad):
    marker(tmp_path)  # a live run: only the count is wrong
    assert main(["scale", str(tmp_path), *items]) == 2
    err = capsys.readouterr().err
    expected = (
        f"flowrl scale: ConfigError: {bad!r}: expected MODEL=N with N a whole number from 1 to 10,000 in ASCII digits"
    )
    assert err.startswith(expected) and err.count("\n") == 1
    assert not (tmp_path / REQUEST).exists()


def test_flowrl_scale_refuses_a_model_given_twice(tmp_path, capsys):
    marker(tmp_path)
    assert main(["scale", str(tmp_path), "policy=2", "reward=1", "policy=3"]) == 2
    assert (
        capsys.readouterr().err == "flowrl scale: ConfigError: 'policy=3': model 'policy' is given twice (once each)\n"
    )


@pytest.mark.parametrize("count, n", [("1", 1), ("0004", 4), (str(MAX_REPLICAS), MAX_REPLICAS)])
def test_flowrl_scale_takes_counts_from_1_to_the_bound(tmp_path, capsys, count, n):
    marker(tmp_path)
    assert main(["scale", str(tmp_path), f"policy={count}", "reward=2"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / REQUEST).read_bytes()) == {"run": "ab" * 16, "sizes": {"policy": n, "reward": 2}}


@pytest.mark.parametrize("sizes", [{"policy": 0}, {"policy": MAX_REPLICAS + 1}, {"": 2}, {"policy": True}])
def test_request_scale_refuses_what_is_not_a_count(tmp_path, sizes):
    marker(tmp_path)
    with pytest.raises(flowrl.ConfigError, match="expected model -> replicas from 1 to 10,000"):
        request_scale(tmp_path, sizes)


def test_flowrl_scale_refuses_a_model_the_live_run_cannot_resize_or_a_name_outside_the_rule(tmp_path, capsys):
    marker(tmp_path, models=["policy", "reward"])
    assert main(["scale", str(tmp_path), "critic=2"]) == 2
    assert capsys.readouterr().err == (
        f"{SCALE}the run live in {tmp_path} has no rollout model 'critic' to resize; its rollout models are "
        "['policy', 'reward']\n"
    )
    assert main(["scale", str(tmp_path), "pölicy=2"]) == 2
    assert "a model name must be 1 to 128 characters" in capsys.readouterr().err
    assert not (tmp_path / REQUEST).exists()
    assert main(["scale", str(tmp_path), "reward=2"]) == 0


def test_a_folder_at_the_request_path_is_refused_by_the_command_in_one_line(tmp_path, capsys):
    marker(tmp_path)
    (tmp_path / REQUEST).mkdir()
    assert main(["scale", str(tmp_path), "policy=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{SCALE}cannot leave a request at {tmp_path / REQUEST}: ") and err.count("\n") == 1
