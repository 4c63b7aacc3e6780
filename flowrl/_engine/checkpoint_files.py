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

import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from .._backends.weight_arrays import unviewed
from .._core.batch import Sample
from .._core.columns import COLUMN_KINDS
from .._core.errors import CheckpointError, ConfigError, ReplicaDiedError, StageError
from .._core.rng_state import check_rng_state
from .._core.sampler import EpisodeBuffer
from .._core.state_format import CheckpointFolders, decode_state, encode_state, shown
from .engine_stats import Counts, EpisodeStats

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._backends.abc import TrainerGroups
    from .._backends.specs import ReplicaHandle
    from .._core.run_config import RunConfig
    from .deployment import Deployment

    Expect = Callable[[bool, str, Any, str], None]  # raises a CheckpointError naming the field

STATE, RELAY = "engine.json", "relay.msgpack"
FORMAT = 1
# engine.json grows by one episode's stats (~0.3-1 KB of JSON) per episode: 128 MiB holds over
# 100,000 episodes, far past any run; a larger file is not one flowrl wrote, and decoding JSON
# takes several times its size in memory
STATE_LIMIT = 128 * 2**20
_MAX_COUNT = 2**62  # sample ids and counters stay int64 everywhere they go


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
    # [dataset index, predicted length, rollouts seen] per prompt (RunConfig.length_field)
    prompt_lengths: list[list[float]] = msgspec.field(default_factory=list)


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
        self.dir = CheckpointFolders(config.checkpoint_dir, config.keep_checkpoints) if config.checkpoint_dir else None
        self.source()  # a bad resume setting fails when the engine is made, not when it starts

    @property
    def writes(self) -> bool:
        return self.dir is not None and self.config.checkpoint_every > 0

    def due(self, episodes_done: int) -> bool:
        return self.writes and episodes_done % self.config.checkpoint_every == 0

    def source(self) -> Path | None:
        """The checkpoint a run starts from, per ``RunConfig.resume``; None: from scratch. A path
        the system cannot use (a NUL in it, a name too long) is a ConfigError naming the setting."""
        resume = self.config.resume
        key = "checkpoint_dir" if resume in ("never", "auto") else "resume"
        try:
            return self._source(resume)
        except (OSError, ValueError) as err:
            value = getattr(self.config, key)
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise ConfigError(
                f"RunConfig.{key}={shown} cannot be used as a folder ({type(err).__name__}: "
                f"{getattr(err, 'strerror', None) or err}); expected the path of a folder"
            ) from err

    def _source(self, resume: str) -> Path | None:
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
        try:
            found = stat.S_ISREG(os.stat(path / STATE).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            found = False  # other errors (a NUL in it, a name too long): the path cannot be one
        if not found:
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

    def load(
        self, folder: Path, *, dataset_size: int, trainers: list[str], targets: list[str]
    ) -> tuple[EngineState, list[EpisodeBuffer]]:
        """The driver's state in ``folder``, checked against this run: its sampling, its
        ``trainers`` and the inference models it syncs (``targets``)."""
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
        relay = _read_relay(folder, state)
        for name, ranks in state.trainer_ranks.items():  # checked before any rank loads anything
            _read_rngs(folder, _rng_file(name), ranks)
        return state, relay

    @staticmethod
    async def restore_trainers(folder: Path, deployment: Deployment) -> None:
        """Every rank loads rank 0's model state and, where the checkpoint has it, its own generators."""
        for name, ranks in deployment.trainers.items():
            model = CheckpointFolders.read(folder, _model_file(name))
            rngs = _read_rngs(folder, _rng_file(name), None)  # its length checked by load()
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


def _read_state(folder: Path) -> EngineState:
    data = CheckpointFolders.read(folder, STATE, limit=STATE_LIMIT)
    try:
        raw = msgspec.json.decode(data)
        _nan_metrics(raw)
        state = msgspec.convert(raw, EngineState, strict=False)  # JSON keys are strings: ranks are ints
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as err:
        raise CheckpointError(f"checkpoint {folder}: {STATE} is not a flowrl engine state ({err})") from err
    if state.format != FORMAT:
        raise CheckpointError(
            f"checkpoint {folder}: {STATE} field format is {state.format}; this flowrl reads format {FORMAT}"
        )
    return state


def _nan_metrics(raw: Any) -> None:
    """JSON wrote a NaN or infinite metric as null: back to NaN (the rest is left to convert)."""
    episodes = raw.get("episodes") if isinstance(raw, dict) else None
    for episode in episodes if isinstance(episodes, list) else []:
        metrics = episode.get("metrics") if isinstance(episode, dict) else None
        for values in metrics.values() if isinstance(metrics, dict) else []:
            if isinstance(values, dict):
                values.update({k: float("nan") for k, v in values.items() if v is None})


def check_state(state: EngineState, folder: Path) -> None:
    """The ranges and cross-field rules every state an engine writes keeps (``LearningState``
    snapshots): a file that breaks one was edited or damaged, and resuming from it would run
    episodes again or skip them."""

    def expect(ok: bool, field: str, value: Any, want: str) -> None:
        if not ok:
            shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
            raise CheckpointError(f"checkpoint {folder}: {STATE} field {field} is {shown}; expected {want}")

    _check_progress(state, expect)
    _check_models(state, expect)
    _check_counts(state, expect)
    _check_lengths(state, expect)


def _check_lengths(state: EngineState, expect: Expect) -> None:
    """Each remembered prompt: [its dataset index, a length, the rollouts it took part in]."""
    want = f"[a dataset index in [0, {state.dataset_size}), a length >= 0, rollouts in [1, 2**62]]"
    for i, row in enumerate(state.prompt_lengths):
        ok = len(row) == 3 and float(row[0]).is_integer() and 0 <= row[0] < state.dataset_size
        ok = ok and 0 <= row[1] < math.inf and 1 <= row[2] <= _MAX_COUNT
        expect(ok, f"prompt_lengths[{i}]", row, want)


def _check_progress(state: EngineState, expect: Expect) -> None:
    """Counters in range; one stats entry per episode done, in order (the list a resumed run's
    stats continue); the sampler no further than the episodes done drew."""
    for key in ("episode", "next_sample_id", "eval_next_id", "eval_runs", "sampler_position"):
        value = getattr(state, key)
        expect(0 <= value <= _MAX_COUNT, key, value, "an int in [0, 2**62]")
    e = state.episode
    expect(len(state.episodes) == e, "episodes", f"{len(state.episodes)} entries", f"one per episode done ({e})")
    bad = next((i for i, s in enumerate(state.episodes) if s.episode != i), None)
    expect(bad is None, f"episodes[{bad}].episode", bad is not None and state.episodes[bad].episode, f"{bad}")
    # the position counts prompts drawn over every pass (it passes dataset_size as the sampler
    # wraps); each episode drew once, and a dataset set again starts over at 0
    prompts = e * (state.sample_per_episode // max(1, state.num_samples_per_prompt))
    drawn = f"<= {prompts} (prompts drawn by {e} episodes)"
    expect(state.sampler_position <= prompts, "sampler_position", state.sampler_position, drawn)


def _check_models(state: EngineState, expect: Expect) -> None:
    """Weight versions: at most one sync per episode (-1, "unknown", only lives between a failed
    send and the restore that follows it, never in a checkpoint); synced models have synced."""
    for name, v in state.weight_versions.items():
        expect(0 <= v <= state.episode, f"weight_versions[{name!r}]", v, f"a version in [0, {state.episode}]")
    for name in state.synced:
        ok = state.weight_versions.get(name, 0) >= 1 and state.synced.count(name) == 1
        expect(ok, "synced", state.synced, "models of weight_versions synced at least once, each named once")
    for name, ranks in state.trainer_ranks.items():
        expect(1 <= ranks <= _MAX_COUNT, f"trainer_ranks[{name!r}]", ranks, "at least 1 rank")


async def _trainer_states(backend: TrainerGroups, ranks: list[ReplicaHandle]) -> list[tuple[bytes | None, bytes]]:
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
    fields = [dict(s) for s in samples]
    # each field's column kind, so that a trainer batch of restored samples is built as before
    kinds = [dict(s.kinds) for s in samples]
    return {"episode": episode.episode_id, "ids": [s.id for s in samples], "fields": fields, "kinds": kinds}


def _check_counts(state: EngineState, expect: Expect) -> None:
    """Per trainer of ``trainer_ranks``, per rank (of this run or an earlier one, which had
    other rank counts): [samples, steps, busy s], none negative."""
    counts = state.trainer_counts
    expect(
        sorted(counts) == sorted(state.trainer_ranks), "trainer_counts", sorted(counts), "the trainers of trainer_ranks"
    )
    for name, ranks in counts.items():
        for rank, c in ranks.items():
            ok = rank >= 0 and len(c) == 3 and all(math.isfinite(x) and x >= 0 for x in c)
            expect(ok, f"trainer_counts[{name!r}][{rank}]", c, "[samples, steps, busy s], each finite and >= 0")


def _read_relay(folder: Path, state: EngineState) -> list[EpisodeBuffer]:
    """The relay episodes in ``folder``: a list of {episode, ids, fields}, episodes done, in order."""
    raw = decode_state(CheckpointFolders.read(folder, RELAY), where=str(folder / RELAY))

    def expect(ok: bool, field: str, value: Any, want: str) -> None:
        if not ok:
            raise CheckpointError(f"checkpoint {folder}: {RELAY} field {field} is {shown(value)}; expected {want}")

    expect(isinstance(raw, list), "(the whole file)", raw, "a list of relay episodes")
    out: list[EpisodeBuffer] = []
    seen: set[int] = set()  # sample ids are unique across the relay (the pipeline numbers each once)
    for i, e in enumerate(raw):
        keys = ("episode", "ids", "fields")
        ok = isinstance(e, dict) and set(e) - {"kinds"} == set(keys)
        expect(ok, f"[{i}]", e, f"a dict with keys {list(keys)} (and kinds)")
        first = out[-1].episode_id + 1 if out else 0
        episode, ids, fields = e["episode"], e["ids"], e["fields"]
        ok = type(episode) is int and first <= episode < state.episode
        expect(ok, f"[{i}].episode", episode, f"an episode done after the one before, in [{first}, {state.episode})")
        top = state.next_sample_id
        ok = isinstance(ids, list) and all(type(x) is int and 0 <= x < top for x in ids)
        expect(ok, f"[{i}].ids", ids, f"a list of sample ids (ints in [0, {top}): {STATE} field next_sample_id)")
        again = _repeated(ids, seen)
        expect(again is None, f"[{i}].ids", ids, f"sample ids each once in the relay (id {again} is there twice)")
        ok = isinstance(fields, list) and len(fields) == len(ids)
        expect(ok, f"[{i}].fields", fields, f"a list of {len(ids)} samples' fields (one per id)")
        bad = next(
            (j for j, f in enumerate(fields) if not isinstance(f, dict) or not all(isinstance(k, str) for k in f)), None
        )
        expect(bad is None, f"[{i}].fields[{bad}]", bad is not None and fields[bad], "a dict of field name -> value")
        kinds = _relay_kinds(e.get("kinds"), fields, expect, f"[{i}].kinds")
        out.append(EpisodeBuffer(episode, [Sample(s, f, k) for s, f, k in zip(ids, fields, kinds, strict=True)]))
    return out


def _relay_kinds(kinds: Any, fields: list[dict[str, Any]], expect: Expect, where: str) -> list[dict[str, str] | None]:
    """Each sample's field -> column kind (None for a checkpoint written before kinds were kept)."""
    if kinds is None:
        return [None] * len(fields)
    expect(isinstance(kinds, list) and len(kinds) == len(fields), where, kinds, f"a list of {len(fields)} dicts")
    for j, (k, f) in enumerate(zip(kinds, fields, strict=True)):
        ok = isinstance(k, dict) and set(k) <= set(f) and all(v in COLUMN_KINDS for v in k.values())
        expect(ok, f"{where}[{j}]", k, f"a dict of its fields' kinds, each one of {list(COLUMN_KINDS)}")
    return [dict(k) for k in kinds]


def _repeated(ids: list[int], seen: set[int]) -> int | None:
    """The first of ``ids`` already in ``seen`` (or twice in ``ids``); the others join ``seen``."""
    for x in ids:
        if x in seen:
            return x
        seen.add(x)
    return None


def _read_rngs(folder: Path, name: str, ranks: int | None) -> list[bytes]:
    """Each rank's random generator state in ``folder`` (rank order, as the bytes the rank
    wrote), each checked here so that a bad one is named before any rank loads anything;
    ``ranks``: how many the checkpoint's trainer had (``trainer_ranks``), one state each."""
    rngs = decode_state(CheckpointFolders.read(folder, name), where=str(folder / name))
    if not isinstance(rngs, list) or not all(isinstance(r, bytes) for r in rngs):
        raise CheckpointError(
            f"checkpoint {folder}: {name} is a {type(rngs).__name__}; expected a list of encoded generator states, "
            "one per rank"
        )
    if ranks is not None and len(rngs) != ranks:
        raise CheckpointError(
            f"checkpoint {folder}: {name} holds {len(rngs)} generator states; expected one per rank of the "
            f"trainer that wrote it ({STATE} field trainer_ranks says {ranks}); its ranks' generators would not be "
            "restored"
        )
    for r, rng in enumerate(rngs):
        where = f"checkpoint {folder}: {name} rank {r}"
        check_rng_state(decode_state(rng, where=f"{folder / name} (rank {r})"), where)
    return rngs
