"""Episode sampling, relay buffer and train-step planning (sans-IO).

- ``EpisodeSampler``: ChatLearn's semantics. Episodes draw consecutive prompts and wrap
  around the dataset; the position carries over from one ``learn`` to the next; an optional
  shuffle permutes each pass over the dataset with a seed; ``n`` samples per prompt (GRPO
  groups) are consecutive, so each group's copies stay together.
- ``RelayBuffer``: the last ``max_relay_episode`` episodes (0: only the current one, -1: all).
- ``plan_steps``: a train epoch as global batches split over data-parallel ranks and
  micro-batches; no divisibility rule, groups never cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Sequence


@dataclass
class EpisodeSampler:
    dataset_size: int
    samples_per_episode: int
    n: int = 1
    shuffle: bool = False
    seed: int = 0
    position: int = 0  # prompts drawn so far, over every episode of the run
    _perm: tuple[int, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dataset_size <= 0:
            raise ConfigError("the dataset is empty; engine.set_dataset(items) needs at least one item")
        if self.samples_per_episode % self.n:
            below = self.samples_per_episode // self.n * self.n
            valid = [v for v in (below, below + self.n) if v > 0]
            raise ConfigError(
                f"sample_per_episode={self.samples_per_episode} is not a whole number of groups of "
                f"num_samples_per_prompt={self.n}; use e.g. {' or '.join(map(str, valid))}"
            )

    @property
    def prompts_per_episode(self) -> int:
        return self.samples_per_episode // self.n

    def next_episode(self) -> list[tuple[int, int]]:
        """(dataset index, copy) for each sample of the next episode, groups consecutive."""
        prompts = [self._index(self.position + k) for k in range(self.prompts_per_episode)]
        self.position += self.prompts_per_episode
        return [(p, c) for p in prompts for c in range(self.n)]

    def _index(self, k: int) -> int:
        epoch, offset = divmod(k, self.dataset_size)
        if not self.shuffle:
            return offset
        if self._perm is None or self._perm[0] != epoch:  # one permutation per pass, cached
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size))
        return int(self._perm[1][offset])


@dataclass
class EpisodeBuffer:
    """One episode's samples, in dataset order (``buffer`` as ChatLearn names it)."""

    episode_id: int
    buffer: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.buffer)


@dataclass
class RelayBuffer:
    max_relay_episode: int = 0
    episodes: list[EpisodeBuffer] = field(default_factory=list)

    def carried(self) -> list[EpisodeBuffer]:
        """The episodes the next ``add`` keeps (what a checkpoint must hold)."""
        keep = self.max_relay_episode
        return list(self.episodes) if keep < 0 else self.episodes[len(self.episodes) - max(1, keep) + 1 :]

    def add(self, episode: EpisodeBuffer) -> None:
        self.episodes.append(episode)
        keep = self.max_relay_episode
        if keep >= 0:
            del self.episodes[: max(0, len(self.episodes) - max(1, keep))]


@dataclass(frozen=True)
class TrainStep:
    """One global batch: per data-parallel rank, its micro-batches as lists of row indices."""

    size: int
    ranks: list[list[list[int]]]


def _split(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``items`` in ``parts`` consecutive runs whose lengths differ by at most one."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + base + (p < extra)
        out.append(list(items[start:end]))
        start = end
    return out


def _groups(num_samples: int, group: int, keys: Sequence[Any] | None) -> list[list[int]]:
    """Rows in groups: runs of equal ``keys`` (a relay may drop or reorder), else blocks of ``group``."""
    if keys is None or group == 1:
        return [list(range(g, min(g + group, num_samples))) for g in range(0, num_samples, group)]
    out: list[list[int]] = []
    for row, key in enumerate(keys):
        if out and keys[out[-1][0]] == key and len(out[-1]) < group:
            out[-1].append(row)
        else:
            out.append([row])
    return out


def plan_steps(
    num_samples: int, *, global_batch: int, micro_batch: int, dp: int, group: int = 1, keys: Sequence[Any] | None = None
) -> list[TrainStep]:
    """Cut ``num_samples`` rows (in order) into global batches over ``dp`` ranks.

    Global batches hold whole groups of ``group`` rows (runs of equal ``keys`` when given);
    the last one may be smaller. Each rank gets a near-equal run of whole groups, cut into
    micro-batches of at most ``micro_batch`` rows. Losses normalised by ``TrainStep.size`` stay exact when shards are
    uneven.
    """
    check_train_sizes(global_batch=global_batch, micro_batch=micro_batch, dp=dp, group=group)
    groups = _groups(num_samples, group, keys)
    steps, start = [], 0
    while start < len(groups):
        chunk, size = [], 0
        while start < len(groups) and size + len(groups[start]) <= global_batch:
            chunk.append(groups[start])
            size += len(groups[start])
            start += 1
        ranks = []
        for rank_groups in _split(chunk, dp):
            rows = [r for g in rank_groups for r in g]
            ranks.append([rows[m : m + micro_batch] for m in range(0, len(rows), micro_batch)])
        steps.append(TrainStep(sum(len(g) for g in chunk), ranks))
    return steps


def check_train_sizes(*, global_batch: int, micro_batch: int, dp: int, group: int = 1) -> None:
    for key, value in (("train_global_batch_size", global_batch), ("train_micro_batch_size", micro_batch)):
        if value <= 0:
            raise ConfigError(f"RunConfig.{key} must be > 0, got {value}")
    if global_batch % group:
        below = global_batch // group * group
        valid = [v for v in (below, below + group) if v > 0]
        raise ConfigError(
            f"train_global_batch_size={global_batch} is not a whole number of groups of num_samples_per_prompt="
            f"{group} (a group is trained together); use e.g. {' or '.join(map(str, valid))}"
        )
    if dp <= 0:
        raise ConfigError(f"a trainer needs at least one data-parallel rank, got {dp}")
