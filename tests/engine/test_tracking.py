"""Experiment tracking read back from disk: TensorBoard event files, the W&B offline run (its
``.wandb`` records), the MLflow file store; callbacks and user loggers; failures that name the
callback or logger; the config mistakes; metrics.jsonl and TensorBoard after a real resume.
In-process engines, and one on the Ray cluster."""

from __future__ import annotations

import json
import os
import struct
from typing import TYPE_CHECKING, Any

import pytest
from _resume_models import CPU, Learner, Policy, dataset, make_engine

import flowrl
from flowrl.testing import flowrl_actor_names

if TYPE_CHECKING:
    from pathlib import Path

INPROCESS = {"pipeline": {"backend": "inprocess", "progress": "off"}, "progress": "off", "policy_replicas": 1}
EPISODES = 3
TRACKED = ("train/learner/loss", "time/rollout_s", "time/train_s", "episode/samples", "staleness/policy/mean")


class Recorder:
    """A user's logger: keeps what the engine hands it."""

    def __init__(self) -> None:
        self.config: list[dict[str, Any]] = []
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.closed = 0

    def log_config(self, config):
        self.config.append(dict(config))

    def log_scalars(self, step, scalars):
        self.steps.append((step, dict(scalars)))

    def close(self):
        self.closed += 1


def expected(stats: flowrl.EngineStats, key: str) -> list[float]:
    """``key``'s value per episode, from the EpisodeStats themselves."""
    pick = {
        "train/learner/loss": lambda e: e.metrics["learner"]["loss"],
        "time/rollout_s": lambda e: e.rollout_s,
        "time/train_s": lambda e: e.train_s,
        "episode/samples": lambda e: float(e.samples),
        "staleness/policy/mean": lambda e: (
            sum(k * n for k, n in e.staleness["policy"].items()) / sum(e.staleness["policy"].values())
        ),
    }[key]
    return [pick(e) for e in stats.episodes]


def tracked_engine(*, callbacks: Any = (), user_loggers: Any = (), **config: Any) -> flowrl.Engine:
    """The numpy policy and torch learner of _resume_models, in process; the relay buffer trains
    on the last two episodes, so the staleness scalars are not all 0."""
    policy = Policy("policy", {"num_replicas": 1, "batch_size": 2, **CPU})
    learner = Learner("learner", {"num_replicas": 1, **CPU})
    cfg = {"sample_per_episode": 8, "num_episode": EPISODES, "train_global_batch_size": 4, "max_relay_episode": 2}
    cfg |= {"pipeline": {"backend": "inprocess", "progress": "off"}, "progress": "off", **config}
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[learner],
        sync=[(learner, policy)],
        config=cfg,
        callbacks=callbacks,
        loggers=user_loggers,
    )
    engine.set_relay_sample_fn(lambda episodes: [s for e in episodes for s in e.buffer])
    engine.set_dataset(dataset())
    return engine


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """One in-process run of 3 episodes into a run folder, with every backend, a user logger and a
    callback; MLFLOW_ALLOW_FILE_STORE unset at the start (the logger sets it)."""
    run_dir = tmp_path_factory.mktemp("tracked")
    loggers = ["tensorboard", {"kind": "wandb", "mode": "offline", "project": "tiny"}, {"kind": "mlflow"}]
    recorder, reports = Recorder(), []
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
        engine = tracked_engine(
            callbacks=[reports.append], user_loggers=[recorder], run_dir=str(run_dir), loggers=loggers
        )
        stats = engine.learn()
        allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    return {"dir": run_dir, "stats": stats, "recorder": recorder, "reports": reports, "allowed": allowed}


def test_tensorboard_event_files_hold_one_scalar_per_episode_equal_to_the_episode_stats(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tracked["dir"] / "tensorboard"))
    events.Reload()
    for key in TRACKED:
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == list(range(EPISODES))
        assert [s.value for s in scalars] == pytest.approx(expected(tracked["stats"], key), rel=1e-6)  # float32
    assert "config/text_summary" in events.Tags()["tensors"]  # the run's config, once


def wandb_records(run_file: Path) -> list[Any]:
    """The records of a ``.wandb`` file: a 7-byte header, then LevelDB's log format (32 KiB blocks
    of chunks, each with a 7-byte header: checksum, length, type; full=1, first=2, middle=3, last=4)."""
    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, chunk, out = 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def test_the_wandb_offline_run_holds_one_history_row_per_episode_equal_to_the_episode_stats(tracked):
    (run_file,) = (tracked["dir"] / "wandb").glob("offline-run-*/run-*.wandb")  # offline: nothing else to reach
    records = wandb_records(run_file)
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    assert [h.step.num for h in history] == list(range(EPISODES))
    # W&B keeps a key with "/" as its parts (nested_key)
    rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in h.item} for h in history]
    for key in TRACKED:
        assert [row[key] for row in rows] == pytest.approx(expected(tracked["stats"], key), rel=1e-12)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert run.project == "tiny" and config["sample_per_episode"] == 8 and config["pipeline"]["backend"] == "inprocess"


def test_the_mlflow_file_store_holds_the_metrics_and_the_config_as_params(tracked):
    from mlflow.tracking import MlflowClient

    assert tracked["allowed"] == "true"  # set for the user: a local folder was asked for
    client = MlflowClient((tracked["dir"] / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("flowrl").experiment_id])
    assert run.info.status == "FINISHED"  # closed when the engine stopped
    for key in TRACKED:
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == list(range(EPISODES))
        assert [m.value for m in history] == pytest.approx(expected(tracked["stats"], key), rel=1e-12)
    assert run.data.params["sample_per_episode"] == "8"
    assert run.data.params["pipeline.backend"] == "inprocess"


def mlflow_status(run_dir: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("flowrl").experiment_id])
    return str(run.info.status)


def wandb_exit_code(run_dir: Path) -> int:
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    (code,) = [r.exit.exit_code for r in wandb_records(run_file) if r.WhichOneof("record_type") == "exit"]
    return int(code)


def test_the_wandb_offline_run_of_a_run_that_ended_well_exits_with_code_0(tracked):
    assert wandb_exit_code(tracked["dir"]) == 0


FAILING_LOGGERS = [{"kind": "wandb", "mode": "offline"}, {"kind": "mlflow"}]


def test_a_failed_run_is_failed_in_mlflow_and_exits_with_code_1_in_wandb(tmp_path):
    def fail(report: flowrl.EpisodeReport) -> None:
        if report.episode == 1:
            raise RuntimeError("enough")

    engine = tracked_engine(callbacks=[fail], run_dir=str(tmp_path), loggers=FAILING_LOGGERS)
    with pytest.raises(flowrl.FlowError, match="enough"):
        engine.learn()
    assert mlflow_status(tmp_path) == "FAILED"
    assert wandb_exit_code(tmp_path) == 1


async def test_a_cancelled_run_is_killed_in_mlflow_and_exits_with_code_1_in_wandb(tmp_path):
    import anyio

    async with anyio.create_task_group() as tg:
        cancel = [lambda report: tg.cancel_scope.cancel()]
        engine = tracked_engine(callbacks=cancel, run_dir=str(tmp_path), loggers=FAILING_LOGGERS)
        tg.start_soon(engine.alearn)
    assert mlflow_status(tmp_path) == "KILLED"
    assert wandb_exit_code(tmp_path) == 1


def test_a_user_logger_is_closed_with_no_argument_when_the_run_fails(tmp_path):
    """The public Logger protocol's close() takes nothing: the outcome goes to the built-in ones only."""
    recorder = Broken()
    with pytest.raises(flowrl.FlowError, match="disk full"):
        tracked_engine(user_loggers=[recorder], run_dir=str(tmp_path), loggers=[{"kind": "mlflow"}]).learn()
    assert recorder.closed == 1 and mlflow_status(tmp_path) == "FAILED"


@pytest.fixture
def no_wandb_key(monkeypatch, tmp_path):
    """No W&B key anywhere W&B looks: an empty netrc file, no WANDB_API_KEY, no WANDB_MODE."""
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login x password y\n")
    monkeypatch.setenv("NETRC", str(netrc))
    return netrc


def test_wandb_online_without_an_api_key_is_a_config_error_naming_the_fix(no_wandb_key):
    with pytest.raises(
        flowrl.ConfigError,
        match=r"RunConfig.loggers\[0\]: kind='wandb' without mode logs online, and no W&B API key was found "
        r"\(WANDB_API_KEY unset, no api.wandb.ai entry in .*netrc\): run `wandb login` first, or set mode: offline",
    ):
        tracked_engine(loggers=["wandb"])
    with pytest.raises(flowrl.FlowError, match=r"WandbLogger: kind='wandb' without mode"):  # made by hand: the same
        flowrl.WandbLogger(dir=no_wandb_key.parent).log_scalars(0, {"x": 1.0})
    assert not (no_wandb_key.parent / "wandb").exists()  # refused before W&B ran


@pytest.mark.parametrize(
    "found",
    ["netrc", "env", "mode", "WANDB_MODE"],
)
def test_wandb_online_with_a_key_or_a_mode_builds(no_wandb_key, monkeypatch, found):
    loggers: list[Any] = ["wandb"]
    if found == "netrc":
        no_wandb_key.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    elif found == "env":
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    elif found == "mode":
        loggers = [{"kind": "wandb", "mode": "disabled"}]
    else:
        monkeypatch.setenv("WANDB_MODE", "offline")
    tracked_engine(loggers=loggers)  # built; it never runs, so W&B is never reached


def test_a_callback_gets_each_episode_s_report_and_a_user_logger_the_same_scalars(tracked):
    reports, recorder, stats = tracked["reports"], tracked["recorder"], tracked["stats"]
    assert [r.episode for r in reports] == list(range(EPISODES))
    assert [r.stats for r in reports] == stats.episodes
    assert all(type(r) is flowrl.EpisodeReport for r in reports)
    assert recorder.steps == [(r.episode, r.scalars) for r in reports]
    assert len(recorder.config) == 1 and recorder.config[0]["sample_per_episode"] == 8  # once, before the scalars
    assert recorder.closed == 1
    for key in TRACKED:
        assert [r.scalars[key] for r in reports] == expected(stats, key)


def test_engine_takes_callbacks_and_loggers_and_a_failing_callback_fails_the_run_by_name(tmp_path):
    recorder, seen = Recorder(), []

    def stop_after_two(report: flowrl.EpisodeReport) -> None:
        seen.append(report.episode)
        if report.episode == 1:
            raise RuntimeError("enough")

    engine = tracked_engine(callbacks=[stop_after_two], user_loggers=[recorder])
    with pytest.raises(
        flowrl.FlowError, match=r"callback .*stop_after_two failed after episode 1: RuntimeError\('enough'\)"
    ):
        engine.learn()
    assert seen == [0, 1] and [step for step, _ in recorder.steps] == [0, 1]
    assert recorder.closed == 1  # closed although the run failed


async def test_loggers_are_closed_when_the_run_is_cancelled(tmp_path):
    """What Ctrl-C does to a run (asyncio cancels it), done by a callback after episode 0."""
    import anyio

    recorder = Recorder()
    async with anyio.create_task_group() as tg:
        engine = tracked_engine(callbacks=[lambda report: tg.cancel_scope.cancel()], user_loggers=[recorder])
        tg.start_soon(engine.alearn)
    assert [step for step, _ in recorder.steps] == [0]
    assert recorder.closed == 1


def test_rlhf_engine_takes_callbacks_and_loggers_too():
    import numpy as np

    from flowrl.testing import CountingTrainer, Scale

    def scale(name, src, dst):
        return Scale(name, {"num_replicas": 1, "batch_size": 4}, srcs=src, dst=dst)

    reports, recorder = [], Recorder()
    engine = flowrl.RLHFEngine(
        scale("policy", ["prompt"], "response"),
        scale("reference", ["response"], "ref"),
        scale("reward", ["response", "ref", "values"], "score"),
        scale("value", ["response"], "values"),
        CountingTrainer("ppo_policy"),
        CountingTrainer("ppo_value"),
        {"sample_per_episode": 4, "progress": "off", "pipeline": {"backend": "inprocess"}},
        callbacks=[reports.append],
        loggers=[recorder],
    )
    engine.set_dataset([{"prompt": np.full(2, float(i))} for i in range(8)])
    engine.learn()
    assert [r.episode for r in reports] == [0] and reports[0].scalars["weights/policy/version"] == 1.0
    assert recorder.steps == [(0, reports[0].scalars)] and recorder.closed == 1


class Broken(Recorder):
    def log_scalars(self, step, scalars):
        if step == 1:
            raise OSError("disk full")
        super().log_scalars(step, scalars)


def test_a_logger_that_raises_fails_the_run_naming_it_and_the_episode_and_is_closed(tmp_path):
    broken, other = Broken(), Recorder()
    engine = tracked_engine(user_loggers=[broken, other])
    with pytest.raises(flowrl.FlowError, match=r"logger Broken object.log_scalars failed after episode 1: OSError"):
        engine.learn()
    assert broken.closed == other.closed == 1


@pytest.mark.parametrize(
    ("loggers", "error"),
    [
        (["tensorbord"], r"LoggerConfig.kind must be one of \['tensorboard', 'wandb', 'mlflow'\], got 'tensorbord'"),
        ([{"kind": "tensorboard", "project": "x"}], r"LoggerConfig\(kind='tensorboard'\) reads the keys dir; it does "),
        ([{"kind": "wandb", "projet": "x"}], r"unknown field `projet` - at `\$.loggers\[0\]`"),
        ([{"kind": "wandb", "mode": "off"}], r"mode \(wandb\) must be one of \['online', 'offline', 'disabled'\]"),
        ([{"kind": "mlflow", "dir": "a", "tracking_uri": "http://x"}], r"give dir .* or tracking_uri, not both"),
        ([3], r"Expected `str \| object`, got `int` - at `\$.loggers\[0\]`"),
    ],
)
def test_a_wrong_logger_in_the_run_config_is_a_config_error_when_the_engine_is_built(loggers, error):
    with pytest.raises(flowrl.ConfigError, match=error):
        tracked_engine(loggers=loggers)


def test_a_logger_whose_package_is_missing_is_a_config_error_with_the_pip_command(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find(name, *a))
    with pytest.raises(
        flowrl.ConfigError,
        match=r"RunConfig.loggers\[1\]: kind='mlflow' needs the package 'mlflow', "
        r"which is not installed: pip install mlflow-skinny",
    ):
        tracked_engine(loggers=["tensorboard", "mlflow"])


def test_wrong_callbacks_and_loggers_given_to_engine_are_refused_naming_them(tmp_path):
    with pytest.raises(
        flowrl.ConfigError,
        match=r"loggers=...\)\[0\]: expected a logger .* got object object without "
        r"log_config, log_scalars, close",
    ):
        tracked_engine(user_loggers=[object()])
    with pytest.raises(flowrl.FlowDefinitionError, match=r"callbacks=...\)\[0\] .* cannot be called with one argument"):
        tracked_engine(callbacks=[lambda: None])

    def log(r):  # not print: Ray swaps builtins.print for a wrapper of its own in this process
        pass

    with pytest.raises(
        flowrl.ConfigError, match=r"a list of functions, got the function .*\.log \(one goes in a list: \[fn\]\)"
    ):
        tracked_engine(callbacks=log)


def test_a_run_file_asks_for_loggers_as_data(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("sample_per_episode: 8\nloggers: [tensorboard, {kind: wandb, mode: offline, project: x}]\n")
    config = flowrl.RunConfig.load(path)
    assert config.loggers == [
        flowrl.LoggerConfig(kind="tensorboard"),
        flowrl.LoggerConfig(kind="wandb", mode="offline", project="x"),
    ]
    toml = tmp_path / "run.toml"
    toml.write_text('sample_per_episode = 8\n[[loggers]]\nkind = "mlflow"\nexperiment = "e"\n')
    assert flowrl.RunConfig.load(toml).loggers == [flowrl.LoggerConfig(kind="mlflow", experiment="e")]


# ---- a real resume: metrics.jsonl and TensorBoard hold each episode once ----
def test_a_resumed_run_leaves_each_episode_once_in_metrics_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, ckpt = tmp_path / "run", str(tmp_path / "ckpt")
    common = {"ranks": 1, "run_dir": str(run_dir), "checkpoint": {"dir": ckpt, "every": 2}, **INPROCESS}
    first, _ = make_engine(num_episode=3, loggers=["tensorboard"], **common)
    first.learn()  # episodes 0, 1, 2; the last checkpoint is after episode 1 (episode-000002)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["episode"] for line in lines] == [0, 1, 2]
    old = run_dir / "old-metrics.jsonl"
    os.link(run_dir / "metrics.jsonl", old)  # the file as the interrupted run left it
    resumed, _ = make_engine(num_episode=4, loggers=["tensorboard"], **common)
    stats = resumed.learn()  # resumes from episode-000002: runs episodes 2 and 3
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["episode"] for line in lines] == [0, 1, 2, 3]
    assert [line["metrics"] for line in lines] == [msgspec_builtins(e.metrics) for e in stats.episodes]
    assert [json.loads(line)["episode"] for line in old.read_text().splitlines()] == [0, 1, 2]  # replaced, not edited
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("train/learner/loss")
    assert [s.step for s in scalars] == [0, 1, 2, 3]  # the first try of episode 2 is purged
    assert [s.value for s in scalars] == pytest.approx(expected(stats, "train/learner/loss"), rel=1e-6)


def msgspec_builtins(value: Any) -> Any:
    return json.loads(json.dumps(value))


def test_metrics_jsonl_drops_a_line_cut_short_and_later_episodes_atomically(tmp_path):
    from flowrl._engine.run_folder import METRICS, RunDir

    lines = [json.dumps({"episode": e, "samples": 8}) + "\n" for e in range(4)]
    (tmp_path / METRICS).write_text("".join(lines) + '{"episode": 4, "sam')  # a killed process's last line
    run = RunDir(tmp_path)
    assert run.drop_from(2) == 3
    assert (tmp_path / METRICS).read_text() == "".join(lines[:2])
    assert run.drop_from(2) == 0


def test_tensorboard_steps_logged_again_replace_the_first_tries(tmp_path):
    """What a trainer rebuilt from a checkpoint does: episodes 1 and 2 again, in the same process."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = flowrl.TensorBoardLogger(tmp_path)
    logger.log_config({"sample_per_episode": 8})
    for step, value in [(0, 0.0), (1, 1.0), (2, 2.0), (1, 10.0), (2, 20.0), (3, 30.0)]:
        logger.log_scalars(step, {"train/x/loss": value})
    logger.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("train/x/loss")] == [(0, 0.0), (1, 10.0), (2, 20.0), (3, 30.0)]


# ---- the Ray backend ----
def test_tensorboard_on_a_ray_engine(ray_cluster, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reports = []
    policy = Policy("policy", {"num_replicas": 2, "batch_size": 2, **CPU})
    learner = Learner("learner", {"num_replicas": 2, **CPU})
    config = {"sample_per_episode": 8, "num_episode": 2, "train_global_batch_size": 4, "progress": "off"}
    config["loggers"] = [{"kind": "tensorboard", "dir": str(tmp_path)}]
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[learner],
        sync=[(learner, policy)],
        config=config,
        callbacks=[reports.append],
    )
    engine.set_dataset(dataset())
    stats = engine.learn()
    assert flowrl_actor_names() == []
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    for key in ("train/learner/loss", "time/rollout_s", "trainer/learner/busy", "rollout/policy.forward_step/busy"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [0, 1]
        assert [s.value for s in scalars] == pytest.approx([r.scalars[key] for r in reports], rel=1e-6)
    assert [r.scalars["train/learner/loss"] for r in reports] == [e.metrics["learner"]["loss"] for e in stats.episodes]
    assert all(0 < r.scalars["rollout/policy.forward_step/busy"] <= 1 for r in reports)
