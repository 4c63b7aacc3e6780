"""Checkpoint files of an RL engine: what one holds, writing it, reading it back.

A checkpoint after episode k holds everything the next episode depends on: the driver's
state (``engine.json``: episode and sample counters, the sampler's position, weight versions,
train counters, episode stats), the relay episodes the next relay call will see
(``relay.msgpack``), per trainer its rank 0 state (weights, optimiser) and every rank's random
generators, and the weights last sent to an inference model when they are not the trainer's
current ones (the checkpoint falls between two syncs). Every file is JSON or the safe
msgpack format of ``_core.training.state_format``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from .._backends.weight_arrays import unviewed
from .._core.errors import CheckpointError, ConfigError, ReplicaDiedError, StageError
from .._core.training.state_format import CheckpointFolders, decode_state, encode_state
from .checkpoint_state import RELAY, STATE, EngineState, check_state, read_relay, read_rngs, read_state

if TYPE_CHECKING:
    from .._backends.abc import TrainerGroups
    from .._backends.specs import ReplicaHandle
    from .._core.settings.run_config import RunConfig
    from .._core.training.sampler import EpisodeBuffer
    from .deployment import Deployment


def _model_file(trainer: str) -> str:
    return _file_of(trainer, "model")


def _rng_file(trainer: str) -> str:
    return _file_of(trainer, "rng")


def _synced_file(target: str) -> str:
    return _file_of(target, "synced")


def _file_of(model: str, kind: str) -> str:
    """``<model>.<kind>.msgpack``, once sure the model's name keeps it in the checkpoint folder
    (CheckpointFolders checks the whole path again when it writes or reads it)."""
    if not model or model in (".", "..") or any(c in model for c in ("/", "\\", "\0")):
        raise CheckpointError(
            f"model name {model!r} cannot name its checkpoint file {model}.{kind}.msgpack: it would lead out of the "
            "checkpoint folder; expected a name without path separators, not '.' or '..'"
        )
    return f"{model}.{kind}.msgpack"


class CheckpointFormat:
    """The engine's checkpoint folder, per ``RunConfig``'s checkpoint keys."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.dir = CheckpointFolders(config.checkpoint.dir, config.checkpoint.keep) if config.checkpoint.dir else None
        self.source()  # a bad resume setting fails when the engine is made, not when it starts

    @property
    def writes(self) -> bool:
        return self.dir is not None and self.config.checkpoint.every > 0

    def due(self, episodes_done: int) -> bool:
        return self.writes and episodes_done % self.config.checkpoint.every == 0

    def source(self) -> Path | None:
        """The checkpoint a run starts from, per ``RunConfig.checkpoint.resume``; None: from scratch. A path
        the system cannot use (a NUL in it, a name too long) is a ConfigError naming the setting."""
        resume = self.config.checkpoint.resume
        key = "dir" if resume in ("never", "auto") else "resume"
        try:
            return self._source(resume)
        except (OSError, ValueError) as err:
            value = getattr(self.config.checkpoint, key)
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise ConfigError(
                f"RunConfig.checkpoint.{key}={shown} cannot be used as a folder ({type(err).__name__}: "
                f"{getattr(err, 'strerror', None) or err}); expected the path of a folder"
            ) from err

    def _source(self, resume: str) -> Path | None:
        if resume == "never":
            done = self.dir.episodes() if self.dir is not None else []
            if done:
                raise CheckpointError(
                    f'RunConfig.checkpoint.resume="never" but RunConfig.checkpoint.dir={self.config.checkpoint.dir!r} '
                    f"already holds checkpoints (after episodes {done}); use another folder, delete them, or "
                    'resume="auto"'
                )
            return None
        if resume == "auto":
            return self.dir.latest() if self.dir is not None else None
        path = Path(resume)
        try:
            found = stat.S_ISREG(os.stat(path / STATE).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            found = False  # other errors (a NUL in it, a name too long): the path cannot be one
        if not found:
            raise CheckpointError(
                f"RunConfig.checkpoint.resume={resume!r}: not a checkpoint folder (no {STATE} in it); give "
                '"auto", "never" or a folder such as <checkpoint.dir>/episode-000004'
            )
        return path

    async def save(
        self, state: EngineState, relay: list[EpisodeBuffer], deployment: Deployment, synced: dict[str, Any]
    ) -> Path:
        """Write ``state`` and the trainers' and ``synced`` weights as one checkpoint."""
        assert self.dir is not None, "save() without a checkpoint.dir"
        files = {STATE: msgspec.json.encode(state), RELAY: encode_state([_episode_state(e) for e in relay])}
        for name, ranks in deployment.trainers.items():
            saved = await _trainer_states(deployment.backend, ranks)
            files[_model_file(name)] = saved[0][0] or b""
            files[_rng_file(name)] = encode_state([rng for _, rng in saved])
        for target, ref in synced.items():
            # as tensors: host weights of a dtype numpy lacks travel as byte arrays (Viewed)
            files[_synced_file(target)] = encode_state(unviewed(await deployment.backend.value(ref)))
        return await anyio.to_thread.run_sync(self.dir.write, state.episode, files)

    def load(
        self, folder: Path, *, dataset_size: int, trainers: list[str], targets: list[str]
    ) -> tuple[EngineState, list[EpisodeBuffer]]:
        """The driver's state in ``folder``, checked against this run: its sampling, its
        ``trainers`` and the inference models it syncs (``targets``)."""
        state = read_state(folder)
        now = sampling(self.config, dataset_size)
        for key in now:
            if getattr(state, key) != now[key]:
                where = "the dataset's length" if key == "dataset_size" else f"RunConfig.{key}"
                raise CheckpointError(
                    f"checkpoint {folder} was written with {key}={getattr(state, key)!r}, this run has "
                    f"{key}={now[key]!r} ({where}); resuming would draw other prompts"
                )
        if sorted(state.trainer_ranks) != sorted(trainers):
            raise CheckpointError(
                f"checkpoint {folder} holds trainers {sorted(state.trainer_ranks)}, this engine has {sorted(trainers)}"
            )
        if sorted(state.weight_versions) != sorted(set(targets)):
            raise CheckpointError(
                f"checkpoint {folder}: {STATE} field weight_versions holds synced models "
                f"{sorted(state.weight_versions)}, this engine syncs {sorted(set(targets))}; resuming would leave a "
                "synced model with weights other than its trainer's"
            )
        check_state(state, folder)
        named = CheckpointFolders.number(folder)
        if named is not None and named != state.episode:
            raise CheckpointError(
                f"checkpoint {folder}: the folder's name says episode {named}, its {STATE} field episode is "
                f"{state.episode!r}; a folder copied or renamed would run episodes again or skip them"
            )
        relay = read_relay(folder, state)
        for name, ranks in state.trainer_ranks.items():  # checked before any rank loads anything
            read_rngs(folder, _rng_file(name), ranks)
        return state, relay

    @staticmethod
    async def restore_trainers(folder: Path, deployment: Deployment) -> None:
        """Every rank loads rank 0's model state and, where the checkpoint has it, its own generators."""
        for name, ranks in deployment.trainers.items():
            model = CheckpointFolders.read(folder, _model_file(name))
            rngs = read_rngs(folder, _rng_file(name), None)  # its length checked by load()
            try:
                async with anyio.create_task_group() as tg:
                    for r, rank in enumerate(ranks):
                        tg.start_soon(deployment.backend.load_state, rank, model, rngs[r] if r < len(rngs) else None)
            except* ReplicaDiedError:
                raise  # a rank died: the caller rebuilds the group
            except* StageError as group:
                # decoded on the rank (the driver never holds the whole model): a damaged file, or a
                # state the model's restore_state refuses, is a checkpoint that does not fit this run
                err = group.exceptions[0]
                raise CheckpointError(
                    f"checkpoint {folder}: trainer {name!r} cannot restore {_model_file(name)}: {err}"
                ) from err

    @staticmethod
    def synced_weights(folder: Path, target: str) -> Any:
        name = _synced_file(target)
        return decode_state(CheckpointFolders.read(folder, name), where=str(folder / name))


def sampling(config: RunConfig, dataset_size: int) -> dict[str, Any]:
    """What decides which prompts come in which order: a checkpoint resumes only the same."""
    return {
        "dataset_size": dataset_size,
        "sample_per_episode": config.sample_per_episode,
        "num_samples_per_prompt": config.num_samples_per_prompt,
        "shuffle": config.shuffle,
        "seed": config.seed,
    }


def _episode_state(episode: EpisodeBuffer) -> dict[str, Any]:
    samples = episode.buffer
    fields = [dict(s) for s in samples]
    # each field's column kind, so that a trainer batch of restored samples is built as before
    kinds = [dict(s.kinds) for s in samples]
    return {"episode": episode.episode_id, "ids": [s.id for s in samples], "fields": fields, "kinds": kinds}


async def _trainer_states(backend: TrainerGroups, ranks: list[ReplicaHandle]) -> list[tuple[bytes | None, bytes]]:
    """Every rank's checkpoint state, read at once."""
    saved: list[tuple[bytes | None, bytes]] = [(None, b"")] * len(ranks)

    async def one(i: int, rank: ReplicaHandle) -> None:
        saved[i] = await backend.save_state(rank)

    async with anyio.create_task_group() as tg:
        for i, rank in enumerate(ranks):
            tg.start_soon(one, i, rank)
    return saved
