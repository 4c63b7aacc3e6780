"""What a backend counts for the live view (``ActorCounts``): actors ready per model, placement
groups reserved, train calls running."""

from __future__ import annotations

import numpy as np
import pytest

import flowrl
from flowrl._backends.specs import ActorCounts, Bundle, ReplicaSpec
from flowrl._core.settings.config import PipelineConfig
from flowrl.testing import CountingTrainer, Scale, flowrl_actor_names


async def test_the_ray_backend_counts_actors_ready_and_their_placement_group_reserved(ray_cluster):
    from flowrl._backends.ray_backend import RayBackend

    model = Scale("counted", {"cpus_per_replica": 0.25}, srcs=["x"], dst="y")
    specs = [ReplicaSpec(model, r, 0.25, 0.5, Bundle("counted-group", r, 2, 0.25, 1.0)) for r in range(2)]
    backend = RayBackend(PipelineConfig())
    backend.counts.expect(specs)
    assert (backend.counts.expected, backend.counts.ready, backend.counts.groups) == (
        {"counted": 2},
        {"counted": 0},
        {"counted-group"},
    )
    try:
        await backend.start(specs)
        assert backend.counts.ready == {"counted": 2} and backend.counts.reserved == {"counted-group"}
    finally:
        await backend.close()
    assert flowrl_actor_names() == []


async def test_the_in_process_backend_counts_ranks_in_a_train_call_and_none_after_it():
    from flowrl._backends.inprocess import InProcessBackend
    from flowrl._core.flow.batch import Batch

    trainer = CountingTrainer("t")
    backend = InProcessBackend()
    seen: list[int] = []
    step = trainer.train_step

    def watched(batch, iteration):
        seen.append(backend.counts.training["t"])  # while the step runs
        return step(batch, iteration)

    trainer.train_step = watched
    (rank,) = await backend.start_trainer([ReplicaSpec(trainer, 0, 1, 0)], timeout_s=10)
    assert backend.counts.ready == {"t": 1}
    shard = backend.put(Batch(ids=[0, 1], fields={"x": np.zeros((2, 1))}))
    await backend.train(rank, shard, [0, 1], 2, 2, 0)
    assert seen == [1] and backend.counts.training == {"t": 0}


def test_counts_start_empty_and_expect_adds_up_by_model():
    counts = ActorCounts()
    policy = Scale("policy", {}, srcs=["x"], dst="y")
    counts.expect([ReplicaSpec(policy, 0, 1, 0)])
    counts.expect([ReplicaSpec(policy, 1, 1, 0)])  # an evaluation pool of the same model
    counts.started("policy")
    assert counts.expected == {"policy": 2} and counts.ready == {"policy": 1} and not counts.groups


async def test_an_in_process_replica_stopped_takes_no_more_shards():
    from flowrl._backends.inprocess import InProcessBackend
    from flowrl._core.flow.batch import Batch
    from flowrl._core.settings.config import Piece, ShardCall

    backend = InProcessBackend(threads=True)
    (handle,) = await backend.start([ReplicaSpec(Scale("s", {}, srcs=["x"], dst="y"), 0, 1, 0)])
    ref = backend.put(Batch(ids=[0], fields={"x": np.zeros((1, 1))}))
    call = ShardCall(
        stage="s.forward_step",
        method="forward_step",
        iteration=0,
        ids=[0],
        pieces=[Piece(producer="input", ref=ref, rows=[0])],
    )
    meta, _ = await backend.call(handle, call)
    assert meta.rows == 1
    await backend.stop([handle])  # e.g. its call hung: a shard queued behind it must not run there
    with pytest.raises(flowrl.ReplicaDiedError, match="the replica was stopped"):
        await backend.call(handle, call)
