"""Checkpoints of an RL engine (layer 6): what one holds, writing it, reading it back.

A checkpoint after episode k holds everything the next episode depends on: the driver's
state (``engine.json``: episode and sample counters, the sampler's position, weight versions,
train counters, episode stats), the relay episodes the next relay call will see
(``relay.msgpack``), per trainer its rank 0 state (weights, optimiser) and every rank's random
generators, and the weights last sent to an inference model when they are not the trainer's
current ones (the checkpoint falls between two syncs). Every file is JSON or the safe
msgpack format of ``_checkpoint``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from .._backends.weight_share import Broadcast
from .._core.batch import Sample
from .._core.errors import CheckpointError, ReplicaDiedError, StageError
from .._core.sampler import EpisodeBuffer, EpisodeSampler, RelayBuffer
from .._core.state_format import CheckpointDir, decode_state, encode_state
from .parts import EpisodeStats, Live

if TYPE_CHECKING:
    from .._core.model import Model
    from .._core.run_config import RunConfig

log = logging.getLogger("flowrl")
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
    trainer_counts: dict[str, dict[int, list[float]]]  # trainer -> rank -> [samples, steps, busy s]
    synced: list[str]  # inference models whose last received weights are in <name>.synced.msgpack
    episodes: list[EpisodeStats]


def _model_file(trainer: str) -> str:
    return f"{trainer}.model.msgpack"


def _rng_file(trainer: str) -> str:
    return f"{trainer}.rng.msgpack"


def _synced_file(target: str) -> str:
    return f"{target}.synced.msgpack"


class Checkpoints:
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

    async def save(self, state: EngineState, relay: list[EpisodeBuffer], live: Live, synced: dict[str, Any]) -> Path:
        """Write ``state`` and the trainers' and ``synced`` weights as one checkpoint."""
        assert self.dir is not None
        files = {STATE: msgspec.json.encode(state), RELAY: encode_state([_episode_state(e) for e in relay])}
        for name, ranks in live.trainers.items():
            saved = [(None, b"")] * len(ranks)

            async def one(i: int, rank: Any) -> None:
                saved[i] = await live.backend.save_state(rank)

            async with anyio.create_task_group() as tg:
                for i, rank in enumerate(ranks):
                    tg.start_soon(one, i, rank)
            files[_model_file(name)] = saved[0][0] or b""
            files[_rng_file(name)] = encode_state([rng for _, rng in saved])
        for target, ref in synced.items():
            files[_synced_file(target)] = encode_state(await live.backend.value(ref))
        return await anyio.to_thread.run_sync(self.dir.write, state.episode, files)

    def load(self, folder: Path, *, dataset_size: int, trainers: list[str]) -> tuple[EngineState, list[EpisodeBuffer]]:
        """The driver's state in ``folder``, checked against this run."""
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
        now = self.sampling(dataset_size)
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

    def sampling(self, dataset_size: int) -> dict[str, Any]:
        """What decides which prompts come in which order: a checkpoint resumes only the same."""
        cfg = self.config
        return {
            "dataset_size": dataset_size,
            "sample_per_episode": cfg.sample_per_episode,
            "num_samples_per_prompt": cfg.num_samples_per_prompt,
            "shuffle": cfg.shuffle,
            "seed": cfg.seed,
        }

    @staticmethod
    async def restore_trainers(folder: Path, live: Live) -> None:
        """Every rank loads rank 0's model state and, where the checkpoint has it, its own generators."""
        for name, ranks in live.trainers.items():
            model = CheckpointDir.read(folder, _model_file(name))
            rngs = decode_state(CheckpointDir.read(folder, _rng_file(name)))
            async with anyio.create_task_group() as tg:
                for r, rank in enumerate(ranks):
                    tg.start_soon(live.backend.load_state, rank, model, rngs[r] if r < len(rngs) else None)

    @staticmethod
    def synced_weights(folder: Path, target: str) -> Any:
        return decode_state(CheckpointDir.read(folder, _synced_file(target)))


class Resumable:
    """The checkpoint half of ``Engine``: write one, resume from one, rebuild a trainer from one."""

    config: RunConfig
    sync_pairs: list[tuple[Model, Model]]
    train_results: list[Any]
    eval_results: list[Any]
    _ckpt: Checkpoints
    _begun: bool
    _restarts: int
    _episode: int
    _sampler: EpisodeSampler | None
    _dataset: list[Any] | None
    _relay: RelayBuffer
    _versions: dict[str, int]
    _counts: dict[str, dict[int, list[float]]]
    _episodes: list[EpisodeStats]
    _sent: dict[str, Any]
    _initial: dict[str, Any]
    _folder: Path | None
    _marks: dict[int, tuple[int, int]]

    async def _send(self, live: Live, name: str, version: int, weights: Any) -> None:
        raise NotImplementedError

    async def _read(self, live: Live, trainer: str) -> Any:
        raise NotImplementedError

    async def _begin(self, live: Live) -> None:
        """Once per engine: resume from a checkpoint, or write the first one (after 0 or the
        resumed episodes) so that a trainer rank dying early has one to be rebuilt from."""
        if self._begun:
            return
        self._begun = True
        source = self._ckpt.source()
        if source is not None:
            await self._restore(live, source)
        elif self._ckpt.writes:
            await self._save(live)

    def _state(self, live: Live) -> EngineState:
        assert self._sampler is not None and self._dataset is not None and live.rollout is not None
        # a rollout running ahead of training already drew the next episode: resume from its start
        position, next_id = self._marks.get(self._episode, (self._sampler.position, live.rollout.numbering()[0]))
        eval_id, eval_runs = live.evaluation.numbering() if live.evaluation is not None else (0, 0)
        between_syncs = self._episode % self.config.sync_every != 0  # the trainer moved on since
        return EngineState(
            episode=self._episode,
            next_sample_id=next_id,
            eval_next_id=eval_id,
            eval_runs=eval_runs,
            sampler_position=position,
            weight_versions=dict(self._versions),
            trainer_ranks={name: len(ranks) for name, ranks in live.trainers.items()},
            trainer_counts={name: {r: list(v) for r, v in c.items()} for name, c in self._counts.items()},
            synced=sorted(n for n, v in self._versions.items() if v and between_syncs),
            episodes=list(self._episodes),
            **self._ckpt.sampling(len(self._dataset)),
        )

    async def _save(self, live: Live) -> None:
        state = self._state(live)
        self._marks = {e: m for e, m in self._marks.items() if e >= self._episode}
        self._folder = await self._ckpt.save(
            state, self._relay.carried(), live, {n: self._sent[n] for n in state.synced}
        )

    async def _restore(self, live: Live, folder: Path) -> None:
        assert self._sampler is not None and self._dataset is not None and live.rollout is not None
        state, relay = self._ckpt.load(folder, dataset_size=len(self._dataset), trainers=list(live.trainers))
        await self._ckpt.restore_trainers(folder, live)
        for trainer, target in self.sync_pairs:
            await self._restore_weights(live, folder, state, trainer.name, target.name)
        self._episode, self._sampler.position = state.episode, state.sampler_position
        self._relay.episodes = relay
        self._counts = {name: {int(r): list(v) for r, v in c.items()} for name, c in state.trainer_counts.items()}
        self._episodes = list(state.episodes)
        await live.rollout.settle()  # a rollout that ran ahead of training is done again
        live.rollout.resume_at(state.next_sample_id, state.episode)
        self._marks = {}
        if live.evaluation is not None:
            live.evaluation.resume_at(state.eval_next_id, state.eval_runs)
        self._folder = folder

    async def _restore_weights(self, live: Live, folder: Path, state: EngineState, trainer: str, target: str) -> None:
        """Give ``target``'s replicas the weights they held at the checkpoint."""
        want = state.weight_versions.get(target, 0)
        # a broadcast's snapshot was the old trainer's: a replica joining later needs one of the new
        rebuilt = isinstance(self._sent.get(target), Broadcast)
        if want == self._versions[target] and not rebuilt:
            return  # they hold them already (a fresh start, or no sync since the checkpoint)
        if target in state.synced:
            weights = live.backend.share(self._ckpt.synced_weights(folder, target))
        elif want:  # written right after a sync: the restored trainer's weights are the ones sent
            weights = await self._read(live, trainer)
        else:
            weights = self._initial.get(target)
            if weights is None or isinstance(weights, StageError):
                why = (
                    "they were not read"
                    if weights is None
                    else f"reading them failed ({weights}); define get_weights on it"
                )
                raise CheckpointError(
                    f"cannot give model {target!r} back the weights it started with (the checkpoint predates its "
                    f"first sync): {why}"
                ) from weights
        await self._send(live, target, want, weights)

    async def _snapshot(self, live: Live, name: str) -> Any:
        """``name``'s weights before its first sync: a rebuild to a checkpoint before it needs them."""
        try:
            return await live.backend.get_weights(live.replicas_of(name)[0])
        except StageError as err:
            return err

    async def _rebuild(self, live: Live, trainer: str, err: ReplicaDiedError) -> None:
        """A rank of ``trainer`` died: start its group again and go back to the last checkpoint."""
        folder, cfg = self._folder, self.config
        if folder is None:
            raise ReplicaDiedError(
                f"{err.message}; no checkpoint to rebuild trainer {trainer!r} from (set RunConfig.checkpoint_dir "
                "and checkpoint_every)",
                err.stage,
                err.replica,
                err.sample_ids,
            ) from err
        if self._restarts >= cfg.max_trainer_restarts:
            raise ReplicaDiedError(
                f"{err.message}; trainer {trainer!r} was rebuilt {self._restarts} times already "
                f"(RunConfig.max_trainer_restarts={cfg.max_trainer_restarts})",
                err.stage,
                err.replica,
                err.sample_ids,
            ) from err
        self._restarts += 1
        log.warning("trainer %r: %s; rebuilding its ranks from checkpoint %s", trainer, err, folder)
        done = self._episode
        await live.restart_trainer(trainer)
        for source, target in self.sync_pairs:
            if source.name == trainer:  # what it sent lived in its process: send again from the checkpoint
                self._versions[target.name] = -1
        await self._restore(live, folder)
        redone = range(self._episode, done)  # episodes whose results are undone, to run again
        del self.train_results[len(self.train_results) - len(redone) :]
        evals = sum(1 for e in redone if cfg.eval_every and (e + 1) % cfg.eval_every == 0)
        del self.eval_results[len(self.eval_results) - evals :]


def _episode_state(episode: EpisodeBuffer) -> dict[str, Any]:
    samples = episode.buffer
    return {"episode": episode.episode_id, "ids": [s.id for s in samples], "fields": [dict(s) for s in samples]}


def _episode_buffer(state: dict[str, Any]) -> EpisodeBuffer:
    return EpisodeBuffer(state["episode"], [Sample(i, f) for i, f in zip(state["ids"], state["fields"])])
