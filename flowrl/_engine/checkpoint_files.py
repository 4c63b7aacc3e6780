"""Checkpoint files of an RL engine: what one holds, writing it, reading it back.

A checkpoint after episode k holds everything the next episode depends on: the driver's
state (``engine.json``: episode and sample counters, the sampler's position, weight versions,
train counters, episode stats), the relay episodes the next relay call will see
(``relay.msgpack``), per trainer its rank 0 state (weights, optimiser) and every rank's random
generators, and the weights last sent to an inference model when they are not the trainer's
current ones (the checkpoint falls between two syncs). Every file is JSON or the safe
msgpack format of ``_core.state_format``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from .._backends.replica import unviewed
from .._core.batch import Sample
from .._core.errors import CheckpointError
from .._core.sampler import EpisodeBuffer
from .._core.state_format import CheckpointDir, decode_state, encode_state
from .stats import Counts, EpisodeStats

if TYPE_CHECKING:
    from .._backends.abc import Trainers
    from .._backends.specs import ReplicaHandle
    from .._core.run_config import RunConfig
    from .deployment import Deployment

STATE, RELAY = "engine.json", "relay.msgpack"
FORMAT = 1


class EngineState(msgspec.Struct, frozen=True, kw_only=True):
    format: int = FORMAT
    episode: int  # episodes done
    next_sample_id: int  # the rollout pipeline's; its next run is number ``episode``
    eval_next_id: int = 0
    eval_runs: int = 0
    sampler_position: int
    dataset_size: int
    sample_per_episode: int
    num_samples_per_prompt: int
    shuffle: bool
    seed: int
    weight_versions: dict[str, int]
    trainer_ranks: dict[str, int]
    trainer_counts: Counts  # trainer -> rank -> [samples, steps, busy s]
    synced: list[str]  # inference models whose last received weights are in <name>.synced.msgpack
    episodes: list[EpisodeStats]


def _model_file(trainer: str) -> str:
    return f"{trainer}.model.msgpack"


def _rng_file(trainer: str) -> str:
    return f"{trainer}.rng.msgpack"


def _synced_file(target: str) -> str:
    return f"{target}.synced.msgpack"


class CheckpointFiles:
    """The engine's checkpoint folder, per ``RunConfig``'s checkpoint keys."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.dir = CheckpointDir(config.checkpoint_dir, config.keep_checkpoints) if config.checkpoint_dir else None
        self.source()  # a bad resume setting fails when the engine is made, not when it starts

    @property
    def writes(self) -> bool:
        return self.dir is not None and self.config.checkpoint_every > 0

    def due(self, episodes_done: int) -> bool:
        return self.writes and episodes_done % self.config.checkpoint_every == 0

    def source(self) -> Path | None:
        """The checkpoint a run starts from, per ``RunConfig.resume``; None: from scratch."""
        resume = self.config.resume
        if resume == "never":
            done = self.dir.episodes() if self.dir is not None else []
            if done:
                raise CheckpointError(
                    f'RunConfig.resume="never" but RunConfig.checkpoint_dir={self.config.checkpoint_dir!r} already '
                    f'holds checkpoints (after episodes {done}); use another folder, delete them, or resume="auto"'
                )
            return None
        if resume == "auto":
            return self.dir.latest() if self.dir is not None else None
        path = Path(resume)
        if not (path / STATE).is_file():
            raise CheckpointError(
                f'RunConfig.resume={resume!r}: not a checkpoint folder (no {STATE} in it); give "auto", "never" '
                "or a folder such as <checkpoint_dir>/episode-000004"
            )
        return path

    async def save(
        self, state: EngineState, relay: list[EpisodeBuffer], deployment: Deployment, synced: dict[str, Any]
    ) -> Path:
        """Write ``state`` and the trainers' and ``synced`` weights as one checkpoint."""
        assert self.dir is not None, "save() without a checkpoint_dir"
        files = {STATE: msgspec.json.encode(state), RELAY: encode_state([_episode_state(e) for e in relay])}
        for name, ranks in deployment.trainers.items():
            saved = await _trainer_states(deployment.backend, ranks)
            files[_model_file(name)] = saved[0][0] or b""
            files[_rng_file(name)] = encode_state([rng for _, rng in saved])
        for target, ref in synced.items():
            # as tensors: host weights of a dtype numpy lacks travel as byte arrays (Viewed)
            files[_synced_file(target)] = encode_state(unviewed(await deployment.backend.value(ref)))
        return await anyio.to_thread.run_sync(self.dir.write, state.episode, files)

    def load(self, folder: Path, *, dataset_size: int, trainers: list[str]) -> tuple[EngineState, list[EpisodeBuffer]]:
        """The driver's state in ``folder``, checked against this run."""
        state = _read_state(folder)
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
        relay = [_episode_buffer(e) for e in decode_state(CheckpointDir.read(folder, RELAY))]
        return state, relay

    @staticmethod
    async def restore_trainers(folder: Path, deployment: Deployment) -> None:
        """Every rank loads rank 0's model state and, where the checkpoint has it, its own generators."""
        for name, ranks in deployment.trainers.items():
            model = CheckpointDir.read(folder, _model_file(name))
            rngs = decode_state(CheckpointDir.read(folder, _rng_file(name)))
            async with anyio.create_task_group() as tg:
                for r, rank in enumerate(ranks):
                    tg.start_soon(deployment.backend.load_state, rank, model, rngs[r] if r < len(rngs) else None)

    @staticmethod
    def synced_weights(folder: Path, target: str) -> Any:
        return decode_state(CheckpointDir.read(folder, _synced_file(target)))


def sampling(config: RunConfig, dataset_size: int) -> dict[str, Any]:
    """What decides which prompts come in which order: a checkpoint resumes only the same."""
    return {
        "dataset_size": dataset_size,
        "sample_per_episode": config.sample_per_episode,
        "num_samples_per_prompt": config.num_samples_per_prompt,
        "shuffle": config.shuffle,
        "seed": config.seed,
    }


def _read_state(folder: Path) -> EngineState:
    try:
        raw = msgspec.json.decode(CheckpointDir.read(folder, STATE))
        for episode in raw.get("episodes", []):  # JSON wrote a NaN or infinite metric as null
            for metrics in episode.get("metrics", {}).values():
                metrics.update({k: float("nan") for k, v in metrics.items() if v is None})
        state = msgspec.convert(raw, EngineState, strict=False)  # JSON keys are strings: ranks are ints
    except (msgspec.DecodeError, msgspec.ValidationError, AttributeError) as err:
        raise CheckpointError(f"checkpoint {folder}: {STATE} is not a flowrl engine state ({err})") from err
    if state.format != FORMAT:
        raise CheckpointError(f"checkpoint {folder}: format {state.format}, this flowrl reads format {FORMAT}")
    return state


async def _trainer_states(backend: Trainers, ranks: list[ReplicaHandle]) -> list[tuple[bytes | None, bytes]]:
    """Every rank's checkpoint state, read at once."""
    saved: list[tuple[bytes | None, bytes]] = [(None, b"")] * len(ranks)

    async def one(i: int, rank: ReplicaHandle) -> None:
        saved[i] = await backend.save_state(rank)

    async with anyio.create_task_group() as tg:
        for i, rank in enumerate(ranks):
            tg.start_soon(one, i, rank)
    return saved


def _episode_state(episode: EpisodeBuffer) -> dict[str, Any]:
    samples = episode.buffer
    return {"episode": episode.episode_id, "ids": [s.id for s in samples], "fields": [dict(s) for s in samples]}


def _episode_buffer(state: dict[str, Any]) -> EpisodeBuffer:
    return EpisodeBuffer(state["episode"], [Sample(i, f) for i, f in zip(state["ids"], state["fields"], strict=True)])
