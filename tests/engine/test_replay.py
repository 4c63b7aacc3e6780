"""Record and replay of an asynchronous schedule (issue 24): the weight version each rollout
sample was generated with is recorded, and a replay generates every sample with it again."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
from _delays import delayed

from flowrl import ConfigError, FlowError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EPISODES = 4


@pytest.fixture
def ppo(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module("ppo_tiny")


def learn(
    ppo: Any, folder: Path, backend: str = "inprocess", ranks: int = 1, **extra: Any
) -> tuple[list[float], dict[str, bytes]]:
    """The reward curve, and each trainer's model as the last checkpoint saved it (``extra``:
    more RunConfig keys; a ``checkpoint`` or ``staleness`` section is merged into the one set here)."""
    checkpoint = {"every": EPISODES, **extra.pop("checkpoint", {}), "dir": str(folder)}
    staleness = {**extra.pop("staleness", {}), "max": 1}
    engine = ppo.make_engine(
        EPISODES, backend, ranks, checkpoint=checkpoint, staleness=staleness, progress="off", **extra
    )
    rewards = ppo.reward_curve(engine.learn())
    last = sorted(folder.glob("episode-*"))[-1]
    return rewards, {p.name: p.read_bytes() for p in sorted(last.glob("*.model.msgpack"))}


def episodes(path: Path) -> list[dict[str, Any]]:
    """A record's episode lines (its first line holds the settings)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert set(lines[0]) == {"settings"}
    return lines[1:]


def settings(path: Path) -> str:
    return path.read_text().splitlines()[0]


def written(path: Path, header: str, log: list[dict[str, Any]]) -> Path:
    path.write_text(header + "\n" + "".join(json.dumps(e) + "\n" for e in log))
    return path


def test_an_asynchronous_run_replays_bit_for_bit(ray_cluster, ppo, tmp_path, monkeypatch):
    """Recorded on Ray (trainers on 2 ranks), replayed in process with another layout of the
    rollout's replicas and random delays in the models' forward passes."""
    record = tmp_path / "schedule.jsonl"
    first = learn(ppo, tmp_path / "a", "ray", 2, reproducibility={"record_schedule": str(record)})
    log = episodes(record)
    assert [e["episode"] for e in log] == list(range(EPISODES))
    versions = [v for e in log for run in e["runs"] for v in run["versions"]["policy"]]
    assert len(versions) == EPISODES * 64 and all(v is not None for v in versions)
    behind = sum(v < e["episode"] for e in log for v in e["runs"][0]["versions"]["policy"])
    assert behind > 0, "no sample was generated a version behind: the run did not test asynchrony"

    delayed(monkeypatch, ppo, 1)
    again = tmp_path / "again.jsonl"
    second = learn(
        ppo,
        tmp_path / "b",
        rollout=(3, 5, 3, 7),
        reproducibility={"replay_schedule": str(record), "record_schedule": str(again)},
    )
    assert second == first
    assert episodes(again) == log


@pytest.mark.slow  # in .ci/run's slow step: kept out of the default run for its time
def test_a_replay_generates_each_sample_with_the_version_the_file_says(ray_cluster, ppo, tmp_path):
    """A schedule written by hand (a split the staleness bound allows, which timing did not
    give; some samples meet the policy's old version and the value model's new one) is followed
    exactly in process and on Ray, and trains the same weights on both."""
    natural = tmp_path / "natural.jsonl"
    plain = learn(ppo, tmp_path / "a", reproducibility={"record_schedule": str(natural)})
    log = episodes(natural)
    for e in log:  # episode e may use versions e-1 and e: alternate them, by blocks of 8 samples
        for run in e["runs"]:
            policy = [max(0, e["episode"] - (i // 8) % 2) for i in range(run["count"])]
            value = [v if (i // 4) % 2 == 0 else e["episode"] for i, v in enumerate(policy)]
            run["versions"] = {"policy": policy, "value": value}
    assert log != episodes(natural)
    wanted = written(tmp_path / "wanted.jsonl", settings(natural), log)
    runs = []
    for backend, ranks in [("inprocess", 1), ("ray", 2)]:
        replayed = tmp_path / f"replayed-{backend}.jsonl"
        runs.append(
            learn(
                ppo,
                tmp_path / backend,
                backend,
                ranks,
                reproducibility={"replay_schedule": str(wanted), "record_schedule": str(replayed)},
            )
        )
        assert episodes(replayed) == log
    assert runs[0] == runs[1]
    assert runs[0][1] != plain[1]  # the versions decide the weights: the replay did change them


def test_replay_settings_are_checked_when_the_engine_is_built(ppo, tmp_path):
    path = tmp_path / "schedule.jsonl"
    with pytest.raises(ConfigError, match="replay_schedule.*cannot read"):
        ppo.make_engine(2, "inprocess", 1, reproducibility={"replay_schedule": str(path)})
    path.write_text('{"episode": 0, "runs": []}\n')
    with pytest.raises(ConfigError, match="its first line holds no settings"):
        ppo.make_engine(2, "inprocess", 1, reproducibility={"replay_schedule": str(path)})
    record = tmp_path / "record.jsonl"
    learn(ppo, tmp_path / "a", reproducibility={"record_schedule": str(record)})
    path.write_text(record.read_text() + '\n{"episode": 9}\n')  # blank lines are skipped
    with pytest.raises(ConfigError, match="line 7 is not a recorded episode"):
        ppo.make_engine(2, "inprocess", 1, staleness={"max": 1}, reproducibility={"replay_schedule": str(path)})
    with pytest.raises(ConfigError, match="name the same file"):
        ppo.make_engine(
            2,
            "inprocess",
            1,
            staleness={"max": 1},
            reproducibility={"replay_schedule": str(record), "record_schedule": str(record)},
        )
    with pytest.raises(ConfigError, match=r"other settings \(max_staleness: recorded 1, now 0\)"):
        ppo.make_engine(
            2, "inprocess", 1, reproducibility={"replay_schedule": str(record)}
        )  # synchronous: it would wait for ever
    log = episodes(record)
    run = log[2]["runs"][0]  # one sample meets the policy's new version and the value's old one, another the reverse
    run["versions"]["policy"][:2], run["versions"]["value"][:2] = [2, 1], [1, 2]
    with pytest.raises(ConfigError, match="in episode 2, some samples met a newer version of one synced model"):
        ppo.make_engine(
            2,
            "inprocess",
            1,
            staleness={"max": 1},
            reproducibility={"replay_schedule": str(written(path, settings(record), log))},
        )


def test_a_replay_of_another_runs_record_says_where_it_differs(ppo, tmp_path):
    record = tmp_path / "schedule.jsonl"
    learn(ppo, tmp_path / "a", reproducibility={"record_schedule": str(record)})
    log = episodes(record)
    log[0]["runs"][0] = {"first": 0, "count": 32, "versions": {"policy": [0] * 32, "value": [0] * 32}}
    other = written(tmp_path / "other.jsonl", settings(record), log)
    engine = ppo.make_engine(
        1, "inprocess", 1, staleness={"max": 1}, reproducibility={"replay_schedule": str(other)}, progress="off"
    )
    with pytest.raises(FlowError, match="recorded with 32 samples from id 0, this run has 64 from id 0"):
        engine.learn()


@pytest.mark.timeout(120)  # a sync waiting for an episode this learn() never rolls out would hang
def test_a_replay_shorter_than_its_record_ends_with_the_records_first_episodes(ppo, tmp_path):
    record = tmp_path / "schedule.jsonl"
    learn(ppo, tmp_path / "a", reproducibility={"record_schedule": str(record)})
    again = tmp_path / "again.jsonl"
    engine = ppo.make_engine(
        2,
        "inprocess",
        1,
        staleness={"max": 1},
        reproducibility={"replay_schedule": str(record), "record_schedule": str(again)},
        progress="off",
    )
    engine.learn()
    assert episodes(again) == episodes(record)[:2]


@pytest.mark.timeout(180)  # a restore waiting for the record's earlier episodes would hang
def test_a_replay_resumed_from_a_checkpoint_says_which_version_it_cannot_give(ppo, tmp_path):
    """A checkpoint holds the newest weights only: resumed from one, the replay of an episode
    whose samples were generated a version behind (rolled out ahead of training) stops with
    an error naming it, instead of waiting for weights that will not come."""
    record = tmp_path / "schedule.jsonl"
    learn(
        ppo,
        tmp_path / "a",
        reproducibility={"record_schedule": str(record)},
        checkpoint={"every": 1, "keep": 0},
    )
    assert all(v == 0 for v in episodes(record)[1]["runs"][0]["versions"]["policy"])  # in process: a version behind
    engine = ppo.make_engine(
        EPISODES,
        "inprocess",
        1,
        checkpoint={"dir": str(tmp_path / "b"), "resume": str(sorted((tmp_path / "a").glob("episode-*"))[1])},
        staleness={"max": 1},
        reproducibility={"replay_schedule": str(record)},
        progress="off",
    )
    with pytest.raises(FlowError, match="episode 1 recorded samples generated by version 0 of .policy.*hold version 1"):
        engine.learn()
