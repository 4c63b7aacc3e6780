"""Checkpoints are checked when an engine resumes from one (in process, and two cases on Ray): a tampered
engine.json or relay.msgpack, a synced model renamed since, a file whose array lies about its
bytes, and model names that would lead file names out of the checkpoint folder are each a
CheckpointError that names the file and the field (the format alone: core/test_state_format.py
and core/test_fuzz_state_format.py)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import numpy as np
import pytest
from _resume_models import CPU, Learner, Policy, dataset, make_engine

import flowrl
from flowrl._core.training.state_format import decode_state, encode_state
from flowrl._engine.checkpoint_files import CheckpointFormat
from flowrl._engine.checkpoint_state import read_relay, read_state

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

INPROCESS = {"pipeline": {"backend": "inprocess"}, "policy_replicas": 1, "ranks": 1}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoints of 3 episodes (sync_every=2: the last falls between two syncs, so it
    holds the policy's synced weights too)."""
    root = tmp_path_factory.mktemp("written")
    engine, _ = make_engine(num_episode=3, checkpoint={"every": 3, "dir": str(root)}, **INPROCESS)
    engine.learn()
    assert sorted(p.name for p in (root / "episode-000003").iterdir()) == [
        "engine.json",
        "learner.model.msgpack",
        "learner.rng.msgpack",
        "policy.synced.msgpack",
        "relay.msgpack",
    ]
    return root


@pytest.fixture
def copy(written: Path, tmp_path: Path) -> Path:
    """A copy of the written checkpoints to tamper with; returns its latest folder."""
    shutil.copytree(written, tmp_path / "ckpt")
    return tmp_path / "ckpt" / "episode-000003"


def resume(folder: Path, **config: Any) -> None:
    engine, _ = make_engine(checkpoint={"dir": str(folder.parent)}, **INPROCESS, **config)
    engine.learn()


def edit_json(folder: Path, **fields: Any) -> None:
    state = json.loads((folder / "engine.json").read_text())
    (folder / "engine.json").write_text(json.dumps({**state, **fields}))


def test_the_untampered_copy_resumes(copy):
    resume(copy)  # the tampered ones below fail for what was changed, nothing else


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"episode": -1}, r"field episode is -1; expected an int in \[0, 2\*\*62\]"),
        ({"episode": 99}, r"field episodes is '3 entries'; expected one per episode done \(99\)"),
        ({"episode": 2**70}, r"field episode is 1180591620717411303424; expected an int in \[0, 2\*\*62\]"),
        ({"sampler_position": -4}, r"field sampler_position is -4; expected an int in \[0, 2\*\*62\]"),
        ({"sampler_position": 25}, r"field sampler_position is 25; expected <= 24 \(prompts drawn by 3 episodes\)"),
        ({"next_sample_id": -1}, r"field next_sample_id is -1"),
        ({"eval_runs": -2}, r"field eval_runs is -2"),
        ({"weight_versions": {"policy": 7}}, r"field weight_versions\['policy'\] is 7; expected a version in \[0, 3\]"),
        ({"trainer_ranks": {"learner": 0}}, r"field trainer_ranks\['learner'\] is 0; expected at least 1 rank"),
        ({"trainer_counts": {"learner": {"0": [8, -1, 0.5]}}}, r"field trainer_counts\['learner'\]\[0\]"),
        ({"synced": ["policy", "policy"]}, r"field synced is \['policy', 'policy'\]"),
        ({"format": 0}, r"field format is 0; this flowrl reads format 1"),
        ({"episodes": []}, r"field episodes is '0 entries'; expected one per episode done \(3\)"),
        ({"prompt_lengths": [[1, 2.0]]}, r"field prompt_lengths\[0\] is \[1.0, 2.0\]; expected \[a dataset index in"),
        (
            {"prompt_lengths": [[999, 2.0, 1]]},
            r"field prompt_lengths\[0\] is \[999.0, 2.0, 1.0\]; expected \[a dataset index in \[0, 20\)",
        ),
        ({"prompt_lengths": [[1, -3.0, 1]]}, r"field prompt_lengths\[0\] is \[1.0, -3.0, 1.0\]"),
        ({"episode": "x"}, r"is not a flowrl engine state \(Expected `int`, got `str` - at `\$.episode`\)"),
    ],
)
def test_a_tampered_engine_json_is_refused_naming_the_field(copy, fields, message):
    edit_json(copy, **fields)
    with pytest.raises(flowrl.CheckpointError, match=f"checkpoint {copy}: engine.json .*{message}"):
        resume(copy)


def test_an_engine_json_too_large_to_be_one_is_refused_before_reading(copy, monkeypatch):
    monkeypatch.setattr("flowrl._engine.checkpoint_state.STATE_LIMIT", 100)
    with pytest.raises(flowrl.CheckpointError, match=r"engine.json has \d+ bytes, more than the 100"):
        resume(copy)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda r: r[0].update(ids=r[0]["ids"][:-1]),
            r"field \[0\].fields is a list of length 8; expected a list of 7",
        ),
        (lambda r: r[0].update(episode=3), r"field \[0\].episode is an int; expected an episode done .* in \[0, 3\)"),
        (lambda r: r[0]["ids"].__setitem__(0, -5), r"field \[0\].ids is a list of length 8; expected a list of sample"),
        (lambda r: r[0]["fields"].__setitem__(2, {1: 2}), r"field \[0\].fields\[2\] is a dict of length 1"),
        (lambda r: r.append(r[0]), r"field \[1\].episode is an int; expected an episode done after the one before"),
        (
            lambda r: r[0].update(kinds=r[0]["kinds"][:-1]),
            r"field \[0\].kinds is a list of length 7; expected a list of 8",
        ),
        (
            lambda r: r[0]["kinds"].__setitem__(1, {"x": "blob"}),
            r"field \[0\].kinds\[1\] is a dict of length 1; expected a dict of its fields' kinds",
        ),
    ],
)
def test_a_tampered_relay_buffer_is_refused_naming_the_field(copy, edit, message):
    relay = decode_state((copy / "relay.msgpack").read_bytes())
    edit(relay)
    (copy / "relay.msgpack").write_bytes(encode_state(relay))
    with pytest.raises(flowrl.CheckpointError, match=f"checkpoint {copy}: relay.msgpack {message}"):
        resume(copy)


def test_relay_samples_resume_with_their_fields_kinds_and_without_them_from_an_older_checkpoint(copy):
    relay = decode_state((copy / "relay.msgpack").read_bytes())
    assert relay[0]["kinds"] and all(k and set(k.values()) <= {"tensor", "array", "list"} for k in relay[0]["kinds"])
    restored = read_relay(copy, read_state(copy))
    assert [dict(s.kinds) for s in restored[0].buffer] == relay[0]["kinds"]
    for episode in relay:  # a checkpoint written before kinds were kept
        del episode["kinds"]
    (copy / "relay.msgpack").write_bytes(encode_state(relay))
    assert all(not s.kinds for s in read_relay(copy, read_state(copy))[0].buffer)


def test_a_renamed_synced_model_is_refused_instead_of_serving_its_initial_weights(copy):
    actor = Policy("actor", {"num_replicas": 1, "batch_size": 2, **CPU})  # the policy, renamed
    learner = Learner("learner", {"num_replicas": 1, **CPU})
    config = {"sample_per_episode": 8, "num_episode": 6, "train_global_batch_size": 4, "train_micro_batch_size": 2}
    config |= {"shuffle": True, "seed": 3, "sync_every": 2, "max_relay_episode": 2}
    config |= {"checkpoint": {"dir": str(copy.parent)}}
    engine = flowrl.Engine(
        rollout=lambda x: actor.forward_step(x),
        train=[learner],
        sync=[(learner, actor)],
        config={**config, "pipeline": {"backend": "inprocess"}},
    )
    engine.set_dataset(dataset())
    with pytest.raises(
        flowrl.CheckpointError,
        match=r"engine.json field weight_versions holds synced models \['policy'\], this engine syncs \['actor'\]",
    ):
        engine.learn()


def lying_array(shape: list[int], raw: bytes) -> msgspec.msgpack.Ext:
    """A float32 array whose header says ``shape`` whatever the bytes that follow."""
    head = msgspec.msgpack.encode(["<f4", shape])
    return msgspec.msgpack.Ext(1, struct.pack("<I", len(head)) + head + raw)


def test_synced_weights_whose_array_lies_about_its_bytes_are_refused_naming_the_file(copy):
    weights = {"weight": lying_array([1, 4], b"\0" * 12), "bias": np.zeros(1, dtype=np.float32)}
    (copy / "policy.synced.msgpack").write_bytes(msgspec.msgpack.encode(weights, enc_hook=encode_state))
    with pytest.raises(
        flowrl.CheckpointError,
        match=rf"checkpoint file {copy}/policy.synced.msgpack is damaged: an array of dtype <f4 and shape "
        r"\[1, 4\] needs 16 bytes, the file holds 12",
    ):
        resume(copy)


@pytest.mark.parametrize(
    "rngs, message",
    [
        (encode_state({"rank": 0}), r"learner.rng.msgpack is a dict; expected a list of encoded generator states"),
        (encode_state([b"\xc1"]), r"checkpoint file .*learner.rng.msgpack \(rank 0\) is damaged"),
        (encode_state([encode_state({"python": [3, [], None], "numpy": {}})]), r"rank 0 field 'python': expected"),
    ],
)
def test_a_bad_generator_file_is_refused_naming_it_before_any_rank_loads(copy, rngs, message):
    (copy / "learner.rng.msgpack").write_bytes(rngs)
    with pytest.raises(flowrl.CheckpointError, match=message):
        resume(copy)


def test_a_model_file_whose_tensor_lies_fails_the_restore_naming_the_damage(copy):
    state = decode_state((copy / "learner.model.msgpack").read_bytes())
    raw = encode_state(state).replace(b"float32", b"float64", 1)  # same bytes, twice the itemsize
    (copy / "learner.model.msgpack").write_bytes(raw)
    with pytest.raises(
        flowrl.CheckpointError,
        match=r"trainer 'learner' cannot restore learner.model.msgpack: .*is damaged: an array of dtype float64",
    ):
        resume(copy)


# ---- names that would lead out of the folder (defence in depth: Model names are checked too) ----
class Stub:
    """A deployment whose trainer has ``name``: what save and restore read of one."""

    def __init__(self, name: str) -> None:
        self.trainers = {name: ["rank"]}
        self.backend = self

    async def save_state(self, rank: Any) -> tuple[bytes, bytes]:
        return encode_state({}), encode_state(None)


@pytest.mark.parametrize("name", ["../evil", "a/b", "..", "a\\b"])
def test_a_model_name_with_a_separator_names_no_checkpoint_file(copy, tmp_path, name):
    config = flowrl.RunConfig(
        sample_per_episode=8, shuffle=True, seed=3, checkpoint={"every": 1, "dir": str(tmp_path / "new")}
    )
    files = CheckpointFormat(config)
    state = files.load(copy, dataset_size=20, trainers=["learner"], targets=["policy"])[0]
    message = rf"model name {name!r} cannot name its checkpoint file .*: it would lead out of the checkpoint folder"
    with pytest.raises(flowrl.CheckpointError, match=message.replace("\\", "\\\\") if "\\" in name else message):
        anyio.run(files.save, state, [], Stub(name), {})
    assert not (tmp_path / "evil.model.msgpack").exists() and not (tmp_path / "new").exists()
    with pytest.raises(flowrl.CheckpointError, match="would lead out of the checkpoint folder"):
        anyio.run(CheckpointFormat.restore_trainers, copy, Stub(name))
    with pytest.raises(flowrl.CheckpointError, match="would lead out of the checkpoint folder"):
        CheckpointFormat.synced_weights(copy, name)


def test_a_checkpoint_past_the_runs_end_is_refused_instead_of_skipping_training(copy):
    with pytest.raises(
        flowrl.CheckpointError, match=r"is after episode 3, past this run's end: learn\(\) runs up to episode 2"
    ):
        resume(copy, num_episode=2)
    engine, _ = make_engine(checkpoint={"dir": str(copy.parent)}, num_episode=3, **INPROCESS)
    assert len(engine.learn().episodes) == 3  # at its end: a rerun of a finished run trains nothing more


# ---- what is read: regular files only, the folder's number, ids, one generator per rank ----
@pytest.mark.timeout(120)  # before the fix a FIFO made resume wait forever
@pytest.mark.parametrize(
    "name",
    ["engine.json", "relay.msgpack", "learner.rng.msgpack", "learner.model.msgpack", "policy.synced.msgpack"],
)
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_without_blocking(copy, name):
    (copy / name).unlink()
    os.mkfifo(copy / name)
    with pytest.raises(flowrl.CheckpointError, match=rf"checkpoint {copy}: {name} is a FIFO; expected a regular file"):
        resume(copy)


@pytest.mark.timeout(120)
def test_a_device_in_place_of_a_checkpoint_file_is_refused(copy):
    (copy / "relay.msgpack").unlink()
    try:
        os.mknod(copy / "relay.msgpack", stat.S_IFCHR | 0o644, os.makedev(1, 5))  # /dev/zero's
    except PermissionError:
        pytest.skip("making a device node needs root")
    with pytest.raises(flowrl.CheckpointError, match=rf"checkpoint {copy}: relay.msgpack is a device"):
        resume(copy)


def test_a_checkpoint_copied_under_another_episodes_name_is_refused(copy):
    shutil.copytree(copy, copy.parent / "episode-000009")
    with pytest.raises(
        flowrl.CheckpointError,
        match=r"episode-000009: the folder's name says episode 9, its engine.json field episode is 3",
    ):
        resume(copy, num_episode=12)


def test_a_linked_episode_folder_is_not_resumed_from(copy, tmp_path):
    shutil.copytree(copy, tmp_path / "elsewhere")
    edit_json(tmp_path / "elsewhere", episode=9)  # would be refused, were it read
    (copy.parent / "episode-000009").symlink_to(tmp_path / "elsewhere")
    resume(copy, num_episode=4)  # from episode 3, the latest real one
    assert (copy.parent / "episode-000009").is_symlink() and (tmp_path / "elsewhere" / "engine.json").exists()


def _relay_ids(folder: Path, edit: Callable[[list[Any], int], None]) -> None:
    relay = decode_state((folder / "relay.msgpack").read_bytes())
    edit(relay, json.loads((folder / "engine.json").read_text())["next_sample_id"])
    (folder / "relay.msgpack").write_bytes(encode_state(relay))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r, top: r[0]["ids"].__setitem__(0, top), r"\[0\].ids is a list of length 8; expected a list of sample"),
        (lambda r, top: r[0]["ids"].__setitem__(0, 2**62 + 1), r"\[0\].ids .*ints in \[0, \d+\)"),
        (lambda r, top: r[0]["ids"].__setitem__(1, r[0]["ids"][0]), r"\[0\].ids .*each once in the relay \(id \d+"),
        (
            lambda r, top: r.insert(0, {**r[0], "episode": r[0]["episode"] - 1}),
            r"\[1\].ids .*each once in the relay \(id \d+ is there twice\)",
        ),
    ],
)
def test_relay_sample_ids_past_the_numbering_or_twice_are_refused(copy, edit, message):
    _relay_ids(copy, edit)
    with pytest.raises(flowrl.CheckpointError, match=rf"checkpoint {copy}: relay.msgpack field {message}"):
        resume(copy)


@pytest.mark.parametrize("count", [0, 2])
def test_a_generator_file_with_another_count_than_the_ranks_is_refused(copy, count):
    rngs = decode_state((copy / "learner.rng.msgpack").read_bytes())
    (copy / "learner.rng.msgpack").write_bytes(encode_state((rngs * 2)[:count]))
    with pytest.raises(
        flowrl.CheckpointError,
        match=rf"learner.rng.msgpack holds {count} generator states; expected one per rank .*trainer_ranks says 1",
    ):
        resume(copy)


@pytest.mark.parametrize(
    "config, key",
    [
        ({"dir": "a\0b"}, "dir"),
        ({"dir": "x" * 5000}, "dir"),
        ({"dir": "x" * 5000, "resume": "never"}, "dir"),
        ({"resume": "a\0b"}, "resume"),
        ({"resume": "x" * 5000}, "resume"),
    ],
)
def test_a_checkpoint_path_the_system_cannot_use_is_a_config_error(config, key):
    # a NUL is refused by RunConfig itself already; a name too long by the checkpoint folder
    with pytest.raises(
        flowrl.ConfigError, match=rf"RunConfig.checkpoint.{key}(=.* cannot be used as a folder| is a path)"
    ):
        CheckpointFormat(flowrl.RunConfig(sample_per_episode=8, checkpoint=config))


# ---- the same on a Ray cluster: the model file is decoded by the trainer's actors ----
def _lying_model_file(folder: Path) -> None:
    raw = encode_state(decode_state((folder / "learner.model.msgpack").read_bytes()))
    (folder / "learner.model.msgpack").write_bytes(raw.replace(b"float32", b"float64", 1))


def _fifo_relay(folder: Path) -> None:
    (folder / "relay.msgpack").unlink()
    os.mkfifo(folder / "relay.msgpack")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (_lying_model_file, r"trainer 'learner' cannot restore learner.model.msgpack: .*is damaged: an array of dtype"),
        (_fifo_relay, r"relay.msgpack is a FIFO; expected a regular file"),
    ],
    ids=["model-file-decoded-by-the-ranks", "fifo-read-by-the-driver"],
)
def test_a_tampered_checkpoint_is_refused_by_name_on_ray_and_leaves_no_actor(ray_cluster, copy, tamper, message):
    from flowrl.testing import flowrl_actor_names

    tamper(copy)
    engine, _ = make_engine(checkpoint={"dir": str(copy.parent)}, policy_replicas=1, ranks=2)
    with pytest.raises(flowrl.CheckpointError, match=message):
        engine.learn()
    assert flowrl_actor_names() == []
