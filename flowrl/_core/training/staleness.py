"""The staleness bound of asynchronous training (sans-IO: no Ray, no event loop).

Weight versions count syncs: an inference model fed by a trainer starts at version 0 and
each sync (after every ``sync_every``-th episode) adds one. Episode ``e`` trains while the
synced models hold version ``e // sync_every``; a sample generated with version ``v`` is
then ``e // sync_every - v`` versions stale. Rollout of episode ``e`` may start once enough
episodes are trained and synced that every replica holds a version within the bound: the
gate below. Versions only grow, so every sample of the episode is within it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

STALE_POLICIES = ("wait", "drop", "regenerate")
SEGMENTS = ("oldest", "newest")  # which segment of a partial rollout its staleness is counted by


def train_version(episode: int, sync_every: int) -> int:
    """The version synced models hold while ``episode`` trains (the syncs before it)."""
    return episode // sync_every


def rollout_needs(episode: int, *, max_staleness: int, sync_every: int, slack: int = 0) -> int:
    """How many episodes must be trained and synced before ``episode``'s rollout starts, so
    that its samples are at most ``max_staleness + slack`` versions old when trained."""
    oldest = train_version(episode, sync_every) - max_staleness - slack  # the oldest version allowed
    return max(0, oldest * sync_every)  # version v is held once episode v * sync_every - 1 is synced


def version_field(model: str) -> str:
    return f"{model}_version"


def staleness_field(model: str) -> str:
    return f"{model}_staleness"


def versions_field(model: str) -> str:
    """Inside a loop: the version of each call of ``model`` (a partial rollout's segments)."""
    return f"{model}_versions"


def generated_with(sample: Mapping[str, Any], model: str, segment: str = "oldest") -> int | None:
    """The version of ``model`` that ``sample`` counts as generated with: of its oldest (or
    newest) segment when a loop recorded them, else its one version; None without either."""
    seen = [int(v) for v in sample.get(versions_field(model), ())]
    version = sample.get(version_field(model))  # a call outside any loop (or a loop's last turn)
    if version is not None:
        seen.append(int(version))
    if not seen:
        return None
    return min(seen) if segment == "oldest" else max(seen)


def lags(sample: Mapping[str, Any], versions: Mapping[str, int], segment: str = "oldest") -> dict[str, int]:
    """Per model in ``versions`` whose version ``sample`` carries: how many versions behind."""
    out = {}
    for m, now in versions.items():
        v = generated_with(sample, m, segment)
        if v is not None:
            out[m] = now - v
    return out


def histogram(
    samples: Sequence[Mapping[str, Any]], versions: Mapping[str, int], segment: str = "oldest"
) -> dict[str, dict[int, int]]:
    """Per model in ``versions``: how many samples were generated how many versions ago."""
    out: dict[str, dict[int, int]] = {}
    for s in samples:
        for model, lag in lags(s, versions, segment).items():
            counts = out.setdefault(model, {})
            counts[lag] = counts.get(lag, 0) + 1
    return {m: dict(sorted(c.items())) for m, c in out.items()}


def segment_histogram(samples: Sequence[Mapping[str, Any]], versions: Mapping[str, int]) -> dict[str, dict[int, int]]:
    """Per model in ``versions``: how many segments (a loop's calls of it) were generated how
    many versions ago; empty for samples generated in one call."""
    out: dict[str, dict[int, int]] = {}
    for s in samples:
        for m, now in versions.items():
            for v in s.get(versions_field(m), ()):
                counts = out.setdefault(m, {})
                counts[now - int(v)] = counts.get(now - int(v), 0) + 1
    return {m: dict(sorted(c.items())) for m, c in out.items()}


def too_stale(
    samples: Sequence[Mapping[str, Any]], versions: Mapping[str, int], bound: int, segment: str = "oldest"
) -> list[int]:
    """Positions of the samples more than ``bound`` versions behind for some model."""
    return [i for i, s in enumerate(samples) if any(lag > bound for lag in lags(s, versions, segment).values())]
