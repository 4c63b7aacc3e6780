"""A memory of how long each prompt's responses were, to predict the next ones (sans-IO).

In RL the same prompts come back every epoch, and the ``n`` samples of a GRPO group share
one, so the lengths a prompt's responses had predict the next ones far better than nothing.
The engine records each rollout's lengths per prompt (its dataset index) and hands the
predictions to the pipeline as cost estimates: every stage then starts the longest predicted
work first, and a shard holds samples of similar predicted length, so a generation call does
not wait on one long sample while its short ones sit finished (padding).

The prediction is the mean over the rollouts a prompt took part in (each rollout's mean over
its samples) until it has seen ``1 / weight`` of them, then a moving average that gives the
latest rollout ``weight``: the sampling noise of single rollouts averages out, and the
prediction still follows the policy as its responses grow or shrink during training. A prompt
never seen is predicted as the mean of those seen (neutral: neither first nor last); with
nothing seen, every cost is 0 and the stages keep the oldest-first order.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence, Sized
from numbers import Real
from typing import Any

from ..errors import ConfigError

WEIGHT = 0.25  # of the latest rollout, once 4 have been seen


def length_of(value: Any, where: str) -> float:
    """A sample's length from its field: a number, or a sequence's ``len()`` (a token list,
    a 1-D tensor or array of token ids)."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected a length (a number or a sequence), got a bool")
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) == 0:  # a 0-dim tensor or numpy scalar
        value = value.item()
    if isinstance(value, Real):  # numpy's scalars register as Real too
        length = float(value)
    elif isinstance(value, Sized) and not isinstance(value, (str, bytes, Mapping)):
        length = float(len(value))
    else:
        raise ConfigError(f"{where}: expected a length (a number or a sequence), got a {type(value).__name__}")
    if not (0.0 <= length < math.inf):
        raise ConfigError(f"{where}: a length must be a finite number >= 0, got {length}")
    return length


class LengthMemory:
    """Per prompt key (a dataset index), the moving average of its responses' lengths."""

    def __init__(self, weight: float = WEIGHT) -> None:
        if not 0 < weight <= 1:
            raise ConfigError(f"LengthMemory: weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._mean: dict[int, float] = {}
        self._seen: dict[int, int] = {}  # rollouts each prompt took part in

    def __len__(self) -> int:
        return len(self._mean)

    def observe(self, keys: Sequence[int], lengths: Sequence[float]) -> None:
        """One rollout's samples: ``keys[i]`` is sample ``i``'s prompt, ``lengths[i]`` its length.
        The samples of one prompt in one rollout count as one observation (their mean)."""
        if len(keys) != len(lengths):
            raise ValueError(f"{len(keys)} keys for {len(lengths)} lengths")
        sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for key, length in zip(keys, lengths, strict=True):
            acc = sums[key]
            acc[0] += length
            acc[1] += 1
        for key, (total, count) in sums.items():
            mean = total / count
            seen = self._seen.get(key, 0) + 1
            old = self._mean.get(key, mean)
            self._mean[key] = old + max(1 / seen, self.weight) * (mean - old)
            self._seen[key] = seen

    def predict(self, key: int) -> float | None:
        return self._mean.get(key)

    def costs(self, keys: Iterable[int]) -> list[float]:
        """A predicted length per key; an unseen prompt gets the mean of the seen ones."""
        keys = list(keys)
        if not self._mean:
            return [0.0] * len(keys)
        neutral = sum(self._mean.values()) / len(self._mean)
        return [self._mean.get(k, neutral) for k in keys]

    def state(self) -> list[list[float]]:
        """[key, mean, rollouts] per prompt, for a checkpoint."""
        return [[float(k), self._mean[k], float(self._seen[k])] for k in sorted(self._mean)]

    def restore(self, rows: Sequence[Sequence[float]]) -> None:
        self._mean, self._seen = {}, {}
        for row in rows:
            if len(row) != 3:
                raise ConfigError(f"a prompt length row must be [index >= 0, length >= 0, rollouts >= 1], got {row}")
            key, mean, seen = row
            if not (float(key).is_integer() and key >= 0 and 0 <= mean < math.inf and seen >= 1):
                raise ConfigError(f"a prompt length row must be [index >= 0, length >= 0, rollouts >= 1], got {row}")
            self._mean[int(key)] = float(mean)
            self._seen[int(key)] = int(seen)
