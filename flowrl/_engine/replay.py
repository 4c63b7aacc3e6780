"""Record and replay of what timing decides in asynchronous training
(``RunConfig.reproducibility.record_schedule``, ``RunConfig.reproducibility.replay_schedule``).

With per-sample random streams a sample's output depends on its id and on the weights that
generated it, not on its replica or shard. Under ``staleness.max`` > 0 those weights are the
one thing timing decides: a sync landing mid-rollout splits an episode's samples between two
versions. The record is that split: per episode, per pipeline run of its rollout (the run,
then a ``regenerate`` run), the first sample id and each sample's version per synced model, a
JSON line per episode.

Replay runs each recorded run as phases, oldest versions first, each phase the samples that
had those versions, under their recorded ids (``AsyncPipeline.run(ids=...)``) and once the
replicas hold them; and it holds back each synced model's sync until no phase of an older
version of that model is left to run (the models' syncs run side by side meanwhile:
``WeightSync.send_all``). Which replica runs what, and when, is free: only the versions are
replayed. A record starts with the settings it holds for (``schedule_settings``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from .._core.errors import ConfigError, FlowError
from .._core.training.staleness import generated_with, versions_field

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._core.flow.batch import Sample
    from .._core.flow.graph import FlowGraph
    from .._core.settings.run_config import RunConfig
    from .._pipeline.pipeline import AsyncPipeline

RECORD, REPLAY = "RunConfig.reproducibility.record_schedule", "RunConfig.reproducibility.replay_schedule"

# one run of a rollout: its first sample id, and per synced model each sample's version (None:
# the sample was dropped, it has none)
RunRecord = dict[str, Any]


def run_record(first: int, count: int, samples: Sequence[Sample], models: Sequence[str]) -> RunRecord:
    """What a finished pipeline run of ``count`` items starting at id ``first`` decided."""
    versions: dict[str, list[int | None]] = {m: [None] * count for m in models}
    for sample in samples:
        for m in models:
            if versions_field(m) in sample:
                raise FlowError(
                    f"{RECORD}: sample {sample.id} was generated in segments by {m!r} (a partial "
                    "rollout); recording the versions of segments is not supported"
                )
            versions[m][sample.id - first] = generated_with(sample, m)
    return {"first": first, "count": count, "versions": versions}


def schedule_settings(config: RunConfig, models: Sequence[str]) -> dict[str, Any]:
    """The settings a record holds good for (its first line): under others the episodes, ids
    and versions differ, and a replay could not follow it."""
    keys = ("sample_per_episode", "num_samples_per_prompt", "seed", "sync_every")
    staleness = {"max_staleness": config.staleness.max, "on_stale": config.staleness.on_stale}
    return {**{k: getattr(config, k) for k in keys}, **staleness, "models": sorted(models)}


class ScheduleLog:
    """Writes the record: its settings, then a JSON line per episode once its rollout is final.
    A run from episode 0 (or into a file not there yet) starts the file afresh; a resumed one
    appends (an episode written again counts by its last line)."""

    def __init__(self, path: str, settings: dict[str, Any]) -> None:
        self.path, self.settings = Path(path), settings
        self._runs: dict[int, list[RunRecord]] = defaultdict(list)
        self._opened = False

    def ran(self, episode: int, index: int, record: RunRecord) -> None:
        if index == 0:  # the rollout of an episode run again (a rebuilt trainer) starts its line again
            self._runs[episode] = []
        self._runs[episode].append(record)

    def done(self, episode: int) -> None:
        fresh = not self._opened and (episode == 0 or not self.path.exists() or not self.path.stat().st_size)
        lines = [json.dumps({"settings": self.settings})] if fresh else []
        lines.append(json.dumps({"episode": episode, "runs": self._runs.pop(episode, [])}))
        if fresh:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w" if fresh else "a") as f:
            f.write("".join(line + "\n" for line in lines))
        self._opened = True


def check_schedule_settings(config: RunConfig, models: Sequence[str], graph: FlowGraph) -> None:
    """Refuse, when the engine is built: recording partial rollouts; a replay file that does not
    read, was recorded under other settings or cannot be replayed; one the run would write over."""
    record, replay = config.reproducibility.record_schedule, config.reproducibility.replay_schedule
    if record is None and replay is None:
        return
    looped = sorted({graph.stages[s].model for loop in graph.loops.values() for s in loop.body} & set(models))
    if looped:
        key = RECORD if record else REPLAY
        raise ConfigError(
            f"{key}: the synced model(s) {looped} run inside a flowrl.loop (a partial rollout, whose segments "
            "may each have a version); recording and replaying those is not supported"
        )
    if replay is None:
        return
    if record is not None and Path(record).resolve() == Path(replay).resolve():
        raise ConfigError(
            f"{RECORD} and {REPLAY} name the same file ({record!r}): the "
            "replay would write over the record it reads; record the replay to another file"
        )
    recorded, runs = read_schedule(replay)
    now = schedule_settings(config, models)
    differ = {k: (recorded.get(k), v) for k, v in now.items() if recorded.get(k) != v}
    if differ:
        said = ", ".join(f"{k}: recorded {a!r}, now {b!r}" for k, (a, b) in differ.items())
        raise ConfigError(f"{REPLAY}={replay!r} was recorded under other settings ({said})")
    for episode, records in runs.items():
        for each in records:
            _check_order(replay, episode, each)


def _check_order(path: str, episode: int, record: RunRecord) -> None:
    """The phases run oldest first, and each model's syncs wait for its older phases: that needs
    an order in which every model's version only grows."""
    keys = list(_phases(record))
    for model in record["versions"]:
        seen = [dict(key).get(model) for key in keys]
        held = [v for v in seen if v is not None]
        if held != sorted(held):
            raise ConfigError(
                f"{REPLAY}={path!r}: in episode {episode}, some samples met a newer version of one "
                f"synced model and an older one of another, and others the reverse ({keys}); replaying that needs "
                "each stage gated on its own model's version, which is not supported"
            )


def read_schedule(path: str) -> tuple[dict[str, Any], dict[int, list[RunRecord]]]:
    """A record's settings and, per episode, its runs."""
    where = f"{REPLAY}={path!r}"
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ConfigError(f"{where}: cannot read it ({err})") from None
    settings: dict[str, Any] | None = None
    out: dict[int, list[RunRecord]] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            if n == 1 and isinstance(entry, dict) and isinstance(entry.get("settings"), dict):
                settings = entry["settings"]
                continue
            out[int(entry["episode"])] = [_checked(r) for r in entry["runs"]]
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{where}: line {n} is not a recorded episode ({err!r}): {line[:120]!r}") from None
    if settings is None:
        raise ConfigError(f"{where}: its first line holds no settings: not a record_schedule file")
    return settings, out


def _checked(record: Any) -> RunRecord:
    first, count, versions = int(record["first"]), int(record["count"]), record["versions"]
    if not isinstance(versions, dict) or any(len(v) != count for v in versions.values()):
        raise ValueError("each model needs one version per sample")
    return {"first": first, "count": count, "versions": versions}


class Replay:
    """Runs a rollout's pipeline runs with the recorded versions, and holds syncs back for them.

    ``WeightSync`` tells it each sync before it starts (``before_send``, which waits while a phase
    of an older version is left to run) and once every replica holds it (``sent``)."""

    def __init__(self, path: str, held: Callable[[], dict[str, int]]) -> None:
        self.path = path
        self.runs = read_schedule(path)[1]
        self._held = held  # the version every replica of each synced model holds (WeightSync's)
        # per episode and model, the versions of phases not run yet: a sync to v waits while one
        # below v is left in an episode this learn() rolls out (``window``)
        self._left: dict[int, dict[str, list[int]]] = {}
        for episode, records in self.runs.items():
            left = self._left[episode] = defaultdict(list)
            for record in records:
                for key in _phases(record):
                    for model, v in key:
                        left[model].append(v)
        self._window: tuple[int, int | None] = (0, None)
        self._moved = anyio.Event()

    def window(self, start: int, stop: int | None) -> None:
        """The episodes whose rollouts are still to run: syncs wait for none outside them (those
        before a resume's first episode, those after the target of ``learn()``)."""
        self._window = (start, stop)
        self._wake()

    async def before_send(self, model: str, version: int) -> None:
        while self._older_left(model, version):
            await self._wait()

    def _older_left(self, model: str, version: int) -> bool:
        start, stop = self._window
        return any(
            v < version
            for episode, left in self._left.items()
            if start <= episode and (stop is None or episode < stop)
            for v in left.get(model, ())
        )

    def sent(self, model: str, version: int) -> None:
        self._wake()

    async def run(
        self, pipe: AsyncPipeline, episode: int, index: int, items: list[dict[str, Any]], costs: list[float] | None
    ) -> list[Sample]:
        """Run ``index`` of ``episode``'s rollout as recorded (it numbers the samples as the run did)."""
        first, run_number = pipe.numbering()
        record = self._record(episode, index, first, len(items))
        self._window = (max(self._window[0], episode), self._window[1])  # rollouts run in episode order
        out: list[Sample] = []
        for key, rows in _phases(record).items():
            await self._reach(episode, key)
            pipe.resume_at(pipe.numbering()[0], run_number)  # every phase is the recorded run's iteration
            out += await pipe.run(
                [items[r] for r in rows],
                ids=[first + r for r in rows],
                costs=None if costs is None else [costs[r] for r in rows],
            )
            for model, v in key:
                left = self._left[episode][model]
                if v in left:  # an episode run again (a rebuilt trainer) finds its phases gone
                    left.remove(v)
            self._wake()
        pipe.resume_at(first + len(items), run_number + 1)
        return sorted(out, key=lambda s: s.id)

    async def _reach(self, episode: int, key: tuple[tuple[str, int], ...]) -> None:
        """Wait until the replicas hold the phase's versions (syncs wait for older phases, so
        they cannot hold a newer one)."""
        for model, v in key:
            while self._held().get(model, 0) < v:
                await self._wait()
            held = self._held().get(model, 0)
            if held != v:
                raise FlowError(
                    f"{REPLAY}={self.path!r}: episode {episode} recorded samples generated by "
                    f"version {v} of {model!r}, whose replicas hold version {held} now: the replay "
                    "cannot follow the record (was it recorded from the same checkpoint and settings?)"
                )

    async def _wait(self) -> None:
        await self._moved.wait()

    def _wake(self) -> None:
        self._moved.set()
        self._moved = anyio.Event()

    def _record(self, episode: int, index: int, first: int, count: int) -> RunRecord:
        records = self.runs.get(episode, [])
        if index >= len(records):
            raise ConfigError(
                f"{REPLAY}={self.path!r}: no record of run {index} of episode {episode}'s rollout "
                f"(the file has episodes {sorted(self.runs)[:5]}...): was it recorded with the same settings?"
            )
        record = records[index]
        if (record["first"], record["count"]) != (first, count):
            raise ConfigError(
                f"{REPLAY}={self.path!r}: episode {episode}'s rollout run {index} was recorded "
                f"with {record['count']} samples from id {record['first']}, this run has {count} from id {first}: "
                "the run's settings differ from the recorded run's"
            )
        return record


def _phases(record: RunRecord) -> dict[tuple[tuple[str, int], ...], list[int]]:
    """A run's rows grouped by their versions (a dropped sample, without one, in the first
    phase), oldest first."""
    models = sorted(record["versions"])
    phases: dict[tuple[tuple[str, int], ...], list[int]] = defaultdict(list)
    for row in range(record["count"]):
        versions = [record["versions"][m][row] for m in models]
        key = tuple((m, v) for m, v in zip(models, versions, strict=True) if v is not None)
        phases[key].append(row)
    return dict(sorted(phases.items(), key=lambda kv: [v for _, v in kv[0]]))
