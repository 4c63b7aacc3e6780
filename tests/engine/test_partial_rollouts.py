"""Partial rollouts in the engine: a loop whose body calls a synced policy generates each sample
in segments, each segment on whatever replica pulls it and with the weights that replica holds
then; every segment's version is recorded, and the staleness bound holds on every trained
sample by its oldest segment (asynchronous training, weights synced while rollouts run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import _loop_models
import pytest
from _loop_models import TOKENS, engine, trained

import flowrl
from flowrl._core.training.staleness import train_version
from flowrl.testing import flowrl_actor_names

EPISODES, PER_EPISODE = 5, 8


@pytest.mark.parametrize("backend, k", [("inprocess", 1), ("ray", 1), ("inprocess", 0)])
def test_every_segment_records_its_version_and_the_bound_holds_on_the_oldest(ray_cluster, backend, k):
    run = engine(backend, k, shuffle=False)
    stats = run.learn()
    if backend == "ray":
        assert flowrl_actor_names() == []
    segments = 0
    for e, episode in enumerate(run.train_results):
        rows = [row for step in episode["learner"] for r in step for row in zip(*r.values(), strict=True)]
        assert len(rows) == PER_EPISODE
        for _, response, versions, seen in rows:
            # a segment of TOKENS tokens per version recorded, each token written by those weights
            sizes = [min(TOKENS, len(response) - TOKENS * i) for i in range(len(versions))]
            assert response == [v for v, n in zip(versions, sizes, strict=True) for _ in range(n)]
            assert len(versions) == -(-len(response) // TOKENS)
            assert seen == train_version(e, 1) - min(versions) <= k  # the oldest segment, within the bound
            segments += len(versions)
        assert sum(stats.episodes[e].segment_staleness["policy"].values()) == sum(len(v) for _, _, v, _ in rows)
        per_sample = [len(v) for _, _, v, _ in rows]
        assert stats.episodes[e].turns == {"segment": {t: per_sample.count(t) for t in sorted(set(per_sample))}}
    assert stats.rollout.loops["segment"].turns == segments


def test_the_newest_segment_may_count_instead():
    stats = engine("inprocess", 1, segment="newest").learn()
    for episode in stats.episodes:  # per sample by its newest segment: never staler than its oldest
        oldest = max(episode.segment_staleness["policy"])
        assert max(episode.staleness["policy"]) <= oldest


def test_a_bad_stale_segment_is_refused():
    with pytest.raises(flowrl.ConfigError, match=r"RunConfig.staleness.segment must be one of \['oldest', 'newest'\]"):
        flowrl.RunConfig(sample_per_episode=1, staleness={"segment": "middle"})


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
def test_a_run_killed_mid_turn_resumes_onto_another_replica_count_exactly(ray_cluster, tmp_path, backend):
    reference = engine(backend, replicas=2)
    reference.learn()
    script = Path(__file__).with_name("_loop_killed_script.py")
    address = [ray_cluster.get_runtime_context().gcs_address] if backend == "ray" else []
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "3", *address],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(_loop_models.__file__).parent), *sys.path])},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (tmp_path / "died-mid-turn").read_text()  # in episode 3, while samples were between segments
    resumed = engine(backend, replicas=3, checkpoint={"every": 1, "dir": str(tmp_path)})
    stats = resumed.learn()
    assert [e.episode for e in stats.episodes][-2:] == [3, 4]
    assert trained(resumed) == trained(reference)[3:]  # same samples, segments, versions, staleness
    assert stats.trainers["learner"].steps == reference.stats().trainers["learner"].steps
    if backend == "ray":
        assert flowrl_actor_names() == []  # the killed driver's actors too


def test_each_episode_logs_its_turns():
    from flowrl._engine.tracking import episode_scalars

    stats = engine("inprocess", num_episode=2).learn()
    counts = stats.episodes[-1].turns["segment"]
    scalars = episode_scalars(stats)
    assert scalars["turns/segment/mean"] == sum(t * n for t, n in counts.items()) / 8
    assert scalars["turns/segment/max"] == max(counts) == 4  # lengths up to 7, two tokens a segment


class _StuckSegmenter(_loop_models.Segmenter):
    """Hangs in episode 1 on the sample whose length is 7, in its second segment, until released."""

    @flowrl.step
    def generate(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        rows = zip(batch["length"], batch["response"], strict=True)
        if iteration == 1 and any(int(n) == 7 and len(t) == TOKENS for n, t in rows):
            RELEASE.wait(120)  # the driver gives up on it first; released when the test ends
        return super().generate(batch, iteration)


RELEASE = threading.Event()


def test_a_sample_dropped_after_its_retries_leaves_its_episode_and_the_run_goes_on():
    policy = _StuckSegmenter(
        "policy",
        {
            "num_replicas": 2,
            "batch_size": 3,
            "call_timeout_s": 2.0,
            "on_timeout": "retry",
            "on_spent": "drop",
            **_loop_models.CPU,
        },
    )
    learner = _loop_models.Learner("learner", {**_loop_models.CPU})
    run = flowrl.Engine(
        rollout=lambda p: flowrl.loop(policy.generate, p, until="finished", max_turns=10, name="segment"),
        train=[learner],
        sync=[(learner, policy)],
        config={
            "sample_per_episode": 8,
            "num_episode": 3,
            "train_global_batch_size": 4,
            "shuffle": False,  # episode 1 draws items 8-15: item 9 (length 7) hangs
            # replicas in threads: a hung call is left behind in its thread, the driver goes on
            "pipeline": {"backend": "inprocess", "inprocess_threads": True, "max_retries": 1},
        },
    )
    run.set_dataset([{"response": [], "length": 1 + (i * 3) % 7} for i in range(16)])
    try:
        stats = run.learn()
    finally:
        RELEASE.set()
    assert [e.failed for e in stats.episodes] == [0, 1, 0]
    assert [e.samples for e in stats.episodes] == [8, 7, 8]
    per_episode = [sum(len(r["ids"]) for step in ep["learner"] for r in step) for ep in run.train_results]
    assert per_episode == [8, 7, 8]  # trained on the others
    (dropped,) = stats.rollout.dropped
    assert (dropped.stage, dropped.turn) == ("policy.generate", 2) and "call_timeout_s=2s" in dropped.reason
    assert stats.rollout.loops["segment"].samples == 23
