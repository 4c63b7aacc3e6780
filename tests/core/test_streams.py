"""Per-sample random streams (sans-IO): seeds from (run seed, stage, sample id, turn)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

import flowrl
from flowrl._core.flow.batch import Batch, Stream
from flowrl._core.flow.streams import derived_seed, row_seeds
from flowrl.rl import sample_rows


def test_a_sample_s_seed_depends_on_its_key_only_not_on_its_shard():
    whole = row_seeds(7, "policy.generate", [0, 1, 2, 3, 4])
    parts = np.concatenate([row_seeds(7, "policy.generate", [3, 4]), row_seeds(7, "policy.generate", [0, 1, 2])])
    assert whole.dtype == np.uint64 and sorted(whole.tolist()) == sorted(parts.tolist())
    assert row_seeds(7, "policy.generate", [3]).tolist() == [whole[3]]


@pytest.mark.parametrize(
    "other",
    [
        (8, "policy.generate", [2], [0]),  # another run seed
        (7, "policy.score", [2], [0]),  # another stage
        (7, "policy.generate", [3], [0]),  # another sample
        (7, "policy.generate", [2], [1]),  # another turn
    ],
)
def test_each_part_of_the_key_gives_another_stream(other):
    assert row_seeds(*other).tolist() != row_seeds(7, "policy.generate", [2], [0]).tolist()


def test_seeds_are_the_same_in_another_process_whatever_its_hash_seed():
    code = (
        "from flowrl._core.flow.streams import row_seeds, derived_seed;"
        "print(row_seeds(3, 'm.s', [5], [2])[0], derived_seed(3, 'eval'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    ).stdout.split()
    assert [int(v) for v in out] == [int(row_seeds(3, "m.s", [5], [2])[0]), derived_seed(3, "eval")]
    assert derived_seed(3, "eval") != derived_seed(4, "eval") and 0 <= derived_seed(3, "eval") < 2**62


def test_a_batch_s_generators_follow_its_samples_through_select_and_merge():
    batch = Batch([10, 11, 12], {"x": [1, 2, 3]})
    batch._stream = Stream(5, "p.g", {10: 1, 11: 2, 12: 3})
    draws = [torch.rand(3, generator=g).tolist() for g in batch.generators()]
    sub = batch.select([2, 0])
    assert [torch.rand(3, generator=g).tolist() for g in sub.generators()] == [draws[2], draws[0]]
    merged = sub.merge(Batch([12, 10], {"y": [0, 0]}))
    assert merged.seeds().tolist() == sub.seeds().tolist()
    assert [r.random() for r in batch.rngs()] == [np.random.default_rng(int(s)).random() for s in batch.seeds()]
    assert pickle.loads(pickle.dumps(batch))._stream is None  # the runtime sets it per step
    plain = Batch([10])  # not handed to a step: seed 0, no stage, turn 0
    assert plain.seeds().tolist() == row_seeds(0, "", [10]).tolist()


def test_sample_rows_draws_each_row_from_its_own_generator():
    probs = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), -1)
    seeds = [11, 12, 13, 14]
    together = sample_rows(probs, [torch.Generator().manual_seed(s) for s in seeds])
    alone = [sample_rows(probs[i : i + 1], [torch.Generator().manual_seed(s)]).item() for i, s in enumerate(seeds)]
    assert together.dtype == torch.long and together.tolist() == alone
    with pytest.raises(flowrl.ConfigError, match=r"sample_rows: 4 rows of probs but 3 generators"):
        sample_rows(probs, [torch.Generator()] * 3)
