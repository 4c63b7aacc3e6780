"""ChatLearn issue #209 in flowrl's API, on a real local Ray cluster.

policy: 2 replicas, batch 4; reference, value, reward: 8 replicas each, batch 2; reward reads
the outputs of policy, reference and value; 16 samples per round, 2 rounds. ChatLearn leaves
half of each 8-replica pool idle and counts 16 consumed samples per replica instead of 32.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import anyio
import numpy as np

import flowrl
from flowrl.testing import Scale, flowrl_actor_names

ROUNDS, PER_ROUND = 2, 16
DOWNSTREAM = ("reference", "value", "reward")


def make_flow():
    small = {"num_replicas": 8, "batch_size": 2, "cpus_per_replica": 0.25, "gpus_per_replica": 0.25}
    # policy: ChatLearn-style sizing, num_gpu=8 with tensor_parallel_size=4 -> 2 replicas
    policy = Scale(
        "policy",
        {"num_gpu": 8, "tensor_parallel_size": 4, "batch_size": 4, "cpus_per_replica": 0.25, "gpus_per_replica": 1},
        srcs=["query"],
        dst="policy_out",
        factor=1.0,
        sleep_s=0.02,
    )
    reference = Scale("reference", small, srcs=["policy_out"], dst="ref_out", factor=2.0, sleep_s=0.01)
    value = Scale("value", small, srcs=["policy_out"], dst="value_out", factor=3.0, sleep_s=0.01)
    reward = Scale("reward", small, srcs=["ref_out", "policy_out", "value_out"], dst="reward_out", sleep_s=0.01)

    def rollout(prompts):
        out = policy.forward_step(prompts)
        ref = reference.forward_step(out)
        val = value.forward_step(out)
        return reward.forward_step(out, ref, val)

    return rollout


async def test_issue_209_every_replica_works_and_counts_are_exact(ray_cluster):
    samples = []
    async with flowrl.open_pipeline(make_flow()) as pipe:
        for r in range(ROUNDS):
            items = [{"query": np.full(3, float(i))} for i in range(r * PER_ROUND, (r + 1) * PER_ROUND)]
            samples += await pipe.run(items)
        stats = pipe.stats()
        assert len(flowrl_actor_names()) == 2 + 3 * 8
    assert flowrl_actor_names() == []  # every actor is gone once the pipeline closes

    # each stage processed each sample id exactly once, and outputs are in dataset order
    assert [s.id for s in samples] == list(range(ROUNDS * PER_ROUND))
    for stage in ("policy", *DOWNSTREAM):
        st = stats[f"{stage}.forward_step"]
        assert st.samples == ROUNDS * PER_ROUND
        assert sum(r.samples for r in st.replicas) == ROUNDS * PER_ROUND
        # the replicas' own running counts agree with the driver's per-replica counters
        consumed = defaultdict(int)
        for s in samples:
            consumed[s[f"{stage}_replica"]] = max(consumed[s[f"{stage}_replica"]], s[f"{stage}_consumed"])
        assert sum(consumed.values()) == ROUNDS * PER_ROUND
        assert {r: consumed.get(r, 0) for r in range(len(st.replicas))} == {r.replica: r.samples for r in st.replicas}

    for stage in DOWNSTREAM:
        st = stats[f"{stage}.forward_step"]
        assert st.max_shard <= 2  # no call exceeds the stage's batch size
        for r in range(ROUNDS):
            used = Counter(s[f"{stage}_replica"] for s in samples if s[f"{stage}_round"] == r)
            assert sorted(used) == list(range(8)), f"{stage} round {r}: replicas used {dict(used)}"

    # reward joined by sample id: (2q + q + 3q) where q is the sample's own query value
    for s in samples:
        assert np.allclose(s["reward_out"], 6.0 * s.id), (s.id, s["reward_out"])


async def test_issue_209_on_the_in_process_backend_is_exact_too():
    async with flowrl.open_pipeline(make_flow(), {"backend": "inprocess", "inprocess_threads": True}) as pipe:
        with anyio.fail_after(60):
            out = await pipe.run([{"query": np.full(3, float(i))} for i in range(PER_ROUND)])
        stats = pipe.stats()
    assert [s.id for s in out] == list(range(PER_ROUND))
    for stage in DOWNSTREAM:
        assert stats[f"{stage}.forward_step"].samples == PER_ROUND
        assert {s[f"{stage}_replica"] for s in out} == set(range(8))
    assert all(np.allclose(s["reward_out"], 6.0 * s.id) for s in out)
