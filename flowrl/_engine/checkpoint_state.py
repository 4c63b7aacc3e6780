"""A checkpoint's driver state, read back and checked: ``engine.json`` (``EngineState``),
the relay episodes (``relay.msgpack``) and every rank's random generators. A file flowrl did
not write, or one changed since, is refused as a ``CheckpointError`` naming the file and the
field, before any rank loads anything."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import msgspec

from .._core.errors import CheckpointError
from .._core.flow.batch import Sample
from .._core.flow.columns import COLUMN_KINDS
from .._core.training.rng_state import check_rng_state
from .._core.training.sampler import EpisodeBuffer
from .._core.training.state_format import CheckpointFolders, decode_state, shown
from .engine_stats import Counts, EpisodeStats

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

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


def read_state(folder: Path) -> EngineState:
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


def read_relay(folder: Path, state: EngineState) -> list[EpisodeBuffer]:
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


def read_rngs(folder: Path, name: str, ranks: int | None) -> list[bytes]:
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
