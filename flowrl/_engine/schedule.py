"""Record and replay of what timing decides in asynchronous training (``RunConfig.record_schedule``,
``RunConfig.replay_schedule``).

With per-sample random streams a sample's output depends on its id and on the weights that
generated it, not on its replica or shard. Under ``max_staleness`` > 0 those weights are the
one thing timing decides: a sync landing mid-rollout splits an episode's samples between two
versions. The record is that split: per episode, per pipeline run of its rollout (the run,
then a ``regenerate`` run), the first sample id and each sample's version per synced model, a
JSON line per episode.

Replay runs each recorded run as phases, oldest version first, each phase the samples that
had that version, under their recorded ids (``AsyncPipeline.run(ids=...)``) and once the
replicas hold that version; and it holds back every sync until no phase of an older version is
left to run. Which replica runs what, and when, is free: only the versions are replayed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from .._core.errors import ConfigError, FlowError
from .._core.staleness import generated_with, versions_field

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from .._core.batch import Sample
    from .._core.run_config import RunConfig
    from .._pipeline.pipeline import AsyncPipeline

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
                    f"RunConfig.record_schedule: sample {sample.id} was generated in segments by {m!r} (a partial "
                    "rollout); recording the versions of segments is not supported"
                )
            versions[m][sample.id - first] = generated_with(sample, m)
    return {"first": first, "count": count, "versions": versions}


class ScheduleLog:
    """Writes the record: a JSON line per episode, once its rollout is final. A run from episode
    0 starts the file afresh; a resumed one appends (an episode written again counts last)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._runs: dict[int, list[RunRecord]] = defaultdict(list)
        self._opened = False

    def ran(self, episode: int, record: RunRecord) -> None:
        self._runs[episode].append(record)

    def done(self, episode: int) -> None:
        line = json.dumps({"episode": episode, "runs": self._runs.pop(episode, [])})
        if not self._opened:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a" if self._opened or episode > 0 else "w") as f:
            f.write(line + "\n")
        self._opened = True


def check_schedule_settings(config: RunConfig) -> None:
    """Refuse a replay file that does not read, or one the same run would write over."""
    record, replay = config.record_schedule, config.replay_schedule
    if replay is None:
        return
    if record is not None and Path(record).resolve() == Path(replay).resolve():
        raise ConfigError(
            f"RunConfig.record_schedule and RunConfig.replay_schedule name the same file ({record!r}): the "
            "replay would write over the record it reads; record the replay to another file"
        )
    read_schedule(replay)


def read_schedule(path: str) -> dict[int, list[RunRecord]]:
    where = f"RunConfig.replay_schedule={path!r}"
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ConfigError(f"{where}: cannot read it ({err})") from None
    out: dict[int, list[RunRecord]] = {}
    for n, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
            out[int(entry["episode"])] = [_checked(r) for r in entry["runs"]]
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"{where}: line {n} is not a recorded episode ({err!r}): {line[:120]!r}") from None
    return out


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
        self.runs = read_schedule(path)
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
                self._left[episode][model].remove(v)
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
                    f"RunConfig.replay_schedule={self.path!r}: episode {episode} recorded samples generated by "
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
                f"RunConfig.replay_schedule={self.path!r}: no record of run {index} of episode {episode}'s rollout "
                f"(the file has episodes {sorted(self.runs)[:5]}...): was it recorded with the same settings?"
            )
        record = records[index]
        if (record["first"], record["count"]) != (first, count):
            raise ConfigError(
                f"RunConfig.replay_schedule={self.path!r}: episode {episode}'s rollout run {index} was recorded "
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
