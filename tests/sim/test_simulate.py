"""The virtual-clock simulator (sans-IO): same scheduler and splitter, simulated replicas."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest

import flowrl
from flowrl._core.errors import ConfigError
from flowrl._sim.push import simulate_push
from flowrl._sim.simulate import SimStage, StageCost, Workload, simulate, tails
from flowrl._tools.scenarios import scenarios


def seed_209(splitter: str = "guided", rounds: int = 1) -> Workload:
    wide = {"replicas": 8, "batch_size": 2, "cost": StageCost(call_s=0.01, per_sample_s=0.001), "splitter": splitter}
    return Workload(
        samples=16 * rounds,
        stages=[
            SimStage(
                name="policy", replicas=2, batch_size=4, cost=StageCost(call_s=0.02, tail_median_s=0.01, tail_sigma=0.5)
            ),
            SimStage(name="reference", inputs=["policy"], **wide),
            SimStage(name="value", inputs=["policy"], **wide),
            SimStage(name="reward", inputs=["policy", "reference", "value"], **wide),
        ],
    )


@pytest.mark.parametrize("splitter", sorted(flowrl.SPLITTERS))
def test_issue_209_uses_every_downstream_replica(splitter):
    result = simulate(seed_209(splitter))
    for stage in ("reference", "value", "reward"):
        assert result.replicas_used[stage] == 8
        assert max(result.shard_sizes[stage]) <= 2
        assert sum(size * n for size, n in result.shard_sizes[stage].items()) == 16  # each sample once


def random_workload(seed: int) -> Workload:
    rng = random.Random(seed)
    stages, names = [], ["input"]
    for k in range(rng.randint(1, 4)):
        inputs = rng.sample(names, rng.randint(1, min(2, len(names))))
        cost = StageCost(
            call_s=rng.uniform(0, 0.05),
            per_sample_s=rng.uniform(0, 0.01),
            tail_median_s=rng.choice([0.0, 0.02]),
            tail_sigma=rng.choice([0.0, 1.0]),
        )
        stages.append(
            SimStage(
                name=f"s{k}",
                inputs=inputs,
                replicas=rng.randint(1, 9),
                batch_size=rng.randint(1, 9),
                cost=cost,
                splitter=rng.choice(sorted(flowrl.SPLITTERS)),
                prefetch=rng.randint(1, 2),
                shard_micro_batches=rng.randint(1, 8),
            )
        )
        names.append(f"s{k}")
    return Workload(
        stages=stages,
        samples=rng.randint(1, 120),
        seed=seed,
        overhead_s=rng.choice([0.0, 0.001]),
        cost_hint_sigma=rng.choice([None, 0.0, 0.5]),
    )


@pytest.mark.parametrize("seed", range(40))
def test_every_sample_runs_once_per_stage_and_no_schedule_beats_the_bound(seed):
    w = random_workload(seed)
    result = simulate(w)
    for st in w.stages:
        assert sum(size * n for size, n in result.shard_sizes[st.name].items()) == w.samples
        # a cost shard holds up to shard_micro_batches micro-batches; the other splitters cut one
        most = st.shard_micro_batches if st.splitter == "cost" else 1
        assert max(result.shard_sizes[st.name]) <= st.batch_size * most
    assert result.makespan_s >= result.lower_bound_s - 1e-9
    assert simulate(w) == result  # deterministic from the seed


def test_runtime_overhead_lengthens_the_makespan():
    free = simulate(seed_209(rounds=4))
    costly = simulate(msgspec_replace(seed_209(rounds=4), overhead_s=0.005))
    assert costly.makespan_s > free.makespan_s


def test_prefetch_never_queues_a_shard_behind_a_heavy_tail_and_hides_the_overhead_of_tiny_calls():
    tail = StageCost(call_s=0.020, tail_median_s=0.040, tail_sigma=1.2)
    tiny = StageCost(call_s=0.001, per_sample_s=0.0005)

    def run(cost: StageCost, samples: int, batch: int, prefetch: int, micro_batches: int = 1) -> float:
        stage = SimStage(
            name="a", replicas=4, batch_size=batch, cost=cost, prefetch=prefetch, shard_micro_batches=micro_batches
        )
        return simulate(Workload(samples=samples, seed=1, stages=[stage], overhead_s=0.0007)).makespan_s

    assert run(tail, 256, 16, prefetch=2) == pytest.approx(run(tail, 256, 16, prefetch=1))
    assert run(tiny, 400, 1, prefetch=2) < 0.95 * run(tiny, 400, 1, prefetch=1)
    # shards of several micro-batches pay the overhead once for them all: they hide it too
    assert run(tiny, 400, 1, prefetch=1, micro_batches=8) < 0.95 * run(tiny, 400, 1, prefetch=1)
    # and a heavy tail still spreads: its calls vary, so they stay one micro-batch each
    assert run(tail, 256, 16, prefetch=2, micro_batches=8) == pytest.approx(run(tail, 256, 16, prefetch=2))


@pytest.mark.parametrize("dispatch_s", [0.0, 0.001, 0.004])
def test_the_dispatch_capacity_caps_calls_per_second_however_many_replicas_wait(dispatch_s):
    stage = SimStage(name="a", replicas=64, batch_size=1, cost=StageCost(call_s=0.002), shard_micro_batches=1)
    result = simulate(Workload(samples=500, stages=[stage], dispatch_s=dispatch_s))
    # 500 one-sample calls of 2 ms: free dispatch runs them in ceil(500 / 64) = 8 waves; with a
    # dispatcher, call k goes out at k * dispatch_s and the replicas are never what waits
    expected = 500 * dispatch_s + 0.002 if dispatch_s else 8 * 0.002
    assert result.makespan_s == pytest.approx(expected)
    assert result.calls == {"a": 500}
    # shards of several micro-batches (the default) make fewer calls, and so wait less for the dispatcher
    merged = simulate(
        Workload(
            samples=500,
            stages=[SimStage(**{**msgspec.structs.asdict(stage), "shard_micro_batches": 8})],
            dispatch_s=dispatch_s,
        )
    )
    assert merged.makespan_s <= result.makespan_s + 1e-9
    if dispatch_s:
        assert merged.calls["a"] < 500 and merged.makespan_s < result.makespan_s


def test_a_thousand_replicas_and_a_hundred_thousand_samples_simulate():
    stages = [
        SimStage(
            name="policy", replicas=1024, batch_size=8, cost=StageCost(call_s=0.05, tail_median_s=0.1, tail_sigma=1.0)
        ),
        SimStage(
            name="reward",
            inputs=["policy"],
            replicas=1024,
            batch_size=16,
            cost=StageCost(call_s=0.01, per_sample_s=0.002),
        ),
    ]
    result = simulate(Workload(stages=stages, samples=100_000))
    assert result.replicas_used == {"policy": 1024, "reward": 1024}
    assert 1.0 <= result.ratio < 2.0


def one_tailed_stage(seed: int, hints: float | None, batch_size: int = 4) -> Workload:
    cost = StageCost(call_s=0.02, tail_median_s=0.03, tail_sigma=1.2)
    stage = SimStage(name="policy", replicas=4, batch_size=batch_size, cost=cost)
    return Workload(samples=64, seed=seed, stages=[stage], cost_hint_sigma=hints)


def test_exact_cost_estimates_meet_the_bound_and_rough_ones_close_most_of_the_gap():
    # A call lasts as long as its longest sample: pulled in arrival order, calls mix short and
    # long samples; with estimates the costliest go first, in calls of similar samples.
    ratios = {h: [simulate(one_tailed_stage(seed, h)).ratio for seed in range(10)] for h in (None, 0.0, 0.5)}
    oblivious, exact, rough = (np.array(ratios[h]) for h in (None, 0.0, 0.5))
    assert np.median(oblivious) > 1.5
    assert exact.max() < 1.05  # longest-first list scheduling: not always perfect, close
    assert (rough - 1).sum() < 0.25 * (oblivious - 1).sum()


def test_bad_workloads_are_rejected():
    with pytest.raises(flowrl.ConfigError, match="cost_hint_sigma must be >= 0"):
        one_tailed_stage(0, -1.0)
    with pytest.raises(flowrl.ConfigError, match="dispatch_s must be >= 0"):
        Workload(samples=4, dispatch_s=-0.1, stages=[SimStage(name="a", replicas=1, batch_size=1)])
    with pytest.raises(flowrl.ConfigError, match="reads \\['nope'\\]"):
        Workload(samples=4, stages=[SimStage(name="a", inputs=["nope"], replicas=1, batch_size=1)])


def msgspec_replace(w: Workload, **changes) -> Workload:
    import msgspec

    return msgspec.structs.replace(w, **changes)


def test_when_calls_cost_more_than_they_carry_shards_stay_full_and_every_replica_still_works():
    free = simulate(seed_209(rounds=2))
    costly = simulate(msgspec_replace(seed_209(rounds=2), overhead_s=0.012))  # 12 ms a call; 7 ms a sample
    assert 1 in free.shard_sizes["reference"]  # a free runtime spreads each wave one sample a replica
    for stage in ("reference", "value", "reward"):
        assert costly.shard_sizes[stage] == {2: 16}
        assert costly.replicas_used[stage] == 8


def test_measured_tails_replace_the_drawn_ones_and_a_longer_one_lengthens_the_run():
    w = scenarios()["chatlearn-209"]
    drawn = tails(w)["policy"]
    given = msgspec.structs.replace(w, tail_s={"policy": drawn.tolist()})
    assert simulate(given).makespan_s == simulate(w).makespan_s
    longer = drawn.copy()
    longer[3] += 1.0  # one sample's generation a second longer: no run is shorter than its path
    slow = simulate(msgspec.structs.replace(w, tail_s={"policy": longer.tolist()}))
    assert slow.lower_bound_s > simulate(w).lower_bound_s + 0.9
    assert slow.makespan_s >= slow.lower_bound_s > longer[3]
    assert list(tails(msgspec.structs.replace(w, tail_s={"policy": longer.tolist()}))["policy"]) == list(longer)


@pytest.mark.parametrize(
    "tail_s, match",
    [
        ({"nope": [0.1] * 16}, "names stage 'nope'"),
        ({"policy": [0.1] * 3}, "one time per sample"),
        ({"policy": [-1.0] * 16}, "must be seconds"),
    ],
)
def test_measured_tails_are_checked(tail_s, match):
    w = scenarios()["chatlearn-209"]
    with pytest.raises(ConfigError, match=match):
        msgspec.structs.replace(w, tail_s=tail_s)


def test_a_call_pays_its_shard_cost_once_however_many_micro_batches_it_holds() -> None:
    cost = StageCost(call_s=0.030, shard_s=0.010)
    w = Workload(
        samples=64, seed=1, stages=[SimStage(name="a", replicas=2, batch_size=1, cost=cost, shard_micro_batches=8)]
    )
    r = simulate(w)
    assert sum(sum(b) for b in r.busy_s.values()) == pytest.approx(r.calls["a"] * 0.010 + 64 * 0.030)
    assert max(r.shard_sizes["a"]) > 1  # the cost splitter merged steps to pay the call's cost less often


def test_push_sends_a_batch_to_a_stage_only_once_the_calls_it_reads_have_ended() -> None:
    w = scenarios()["batch1-scorers"]
    push = simulate_push(w)
    reward = w.stages[2].cost
    one_call = reward.shard_s + w.stages[0].batch_size * reward.call_s  # a batch of 8, one step each
    # the last batch's reward call starts after its reference call, which ends the reference's work
    assert push.makespan_s >= max(push.busy_s["reference"]) + one_call - 1e-9


def test_batch1_scorers_behind_uneven_policy_batches_pull_in_at_most_085x_pushs_time() -> None:
    w = scenarios()["batch1-scorers-tail"]
    pull, push = simulate(w), simulate_push(w)
    assert pull.makespan_s <= 0.85 * push.makespan_s
    assert max(pull.shard_sizes["reference"]) > 1  # calls of several steps pay the call's cost less often
