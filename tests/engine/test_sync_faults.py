"""A policy replica whose process dies inside ``set_weights`` during a weight sync, on a real
local Ray cluster: it is retired from its pool as a death in a shard would retire it, and the
run goes on with the others; only when every replica has died does the run fail."""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import numpy as np
import pytest
from _linear_models import LinearTrainer

import flowrl
from flowrl._backends.specs import ReplicaHandle
from flowrl._backends.weight_share import Broadcast, Group
from flowrl._core.errors import ReplicaDiedError, StageError
from flowrl._engine.weight_sync import WeightSync
from flowrl.testing import flowrl_actor_names

torch = pytest.importorskip("torch")

CPU = {"cpus_per_replica": 0.1}
EPISODES, PER_EPISODE = 3, 8


class Policy(flowrl.Model):
    """Reports the sum of the weights it computed with; a replica in ``dying`` that takes a
    token from ``tokens`` (a ``ray.util.queue.Queue``) in ``set_weights`` kills its own process."""

    def __init__(self, name: str, config: Any, *, tokens: Any, dying: tuple[int, ...], in_shard: bool = False) -> None:
        super().__init__(name, config)
        self.tokens, self.dying, self.in_shard = tokens, dying, in_shard  # in_shard: dies in forward_step

    def _maybe_die(self) -> None:
        if self.replica_id in self.dying and not self.tokens.empty():
            self.tokens.get()  # one death per token
            os.kill(os.getpid(), signal.SIGKILL)

    def setup(self) -> None:
        self.module = torch.nn.Linear(4, 1)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        if self.in_shard:
            self._maybe_die()
        return {
            f"{self.name}_w": [float(self.module.weight.detach().sum())] * len(batch),
            f"{self.name}_replica": [self.replica_id] * len(batch),
        }

    def set_weights(self, weights: Any) -> None:
        if not self.in_shard:
            self._maybe_die()
        super().set_weights(weights)


def _engine(
    tokens: Any, dying: tuple[int, ...], transport: str, in_shard: bool = False, healing: Any = None, **config: Any
) -> flowrl.Engine:
    """Healing off by default: these tests follow the pool that runs on without the dead replica."""
    policy = Policy(
        "policy",
        {"num_replicas": 2, "batch_size": 1, "healing": healing, **CPU},
        tokens=tokens,
        dying=dying,
        in_shard=in_shard,
    )
    trainer = LinearTrainer("trainer", {"weight_transport": transport, **CPU})
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[trainer],
        sync=[(trainer, policy)],
        config={"sample_per_episode": PER_EPISODE, "num_episode": EPISODES, "progress": "off", **config},
    )
    engine.set_dataset([{"x": np.ones(4, dtype=np.float32) * (i % 3)} for i in range(EPISODES * PER_EPISODE)])
    return engine


@pytest.mark.parametrize(
    ("transport", "staleness"),
    [("host", 0), pytest.param("nccl", 0, marks=pytest.mark.slow), pytest.param("host", 1, marks=pytest.mark.slow)],
    ids=["host", "broadcast", "host-overlapped"],
)
def test_a_replica_killed_in_set_weights_is_retired_and_the_run_completes_on_the_other(
    ray_cluster, transport, staleness
):
    from ray.util.queue import Queue

    tokens = Queue(actor_options={"num_cpus": 0})
    tokens.put(True)  # replica 1 dies at the first sync
    probe = [{"x": np.ones(4, dtype=np.float32)} for _ in range(6)]
    engine = _engine(tokens, (1,), transport, staleness={"max": staleness})
    try:
        with engine:
            stats = engine.learn()
            trained = engine.train_results[-1]["trainer"][-1][0]["w_sum"]
            rollout = engine._session.deployment.rollout
            before = engine._portal.call(rollout.run, probe)
            serving = rollout.serving("policy")
            groups = dict(engine._session.weights.groups)
            assert engine.resize("policy", 2) == [2]  # a new replica (ids are not reused) joins
            after = engine._portal.call(rollout.run, probe)
            final = engine.stats()
        left_empty = tokens.empty()
    finally:
        tokens.shutdown()
    assert left_empty  # the death happened
    assert [e.weight_versions["policy"] for e in stats.episodes] == [1, 2, 3]
    policy = stats.rollout.stages["policy.forward_step"]
    assert policy.samples == EPISODES * PER_EPISODE  # every sample counted once
    if not staleness:  # the sync ran between rollouts: the dead replica held no shard
        assert policy.retried == 0
    assert serving == [0] and stats.rollout.serving == {"policy": 1}
    # the survivor holds the last version: it computes with the trainer's final weights
    assert {s["policy_replica"] for s in before} == {0}
    assert {round(s["policy_w"], 5) for s in before} == {round(trained, 5)}
    assert {s["policy_version"] for s in before} == {EPISODES}
    if transport == "nccl":  # the last broadcast's group holds the survivor only (and the trainer)
        assert len(groups["policy"][0]) == 3
    # the replica added after the retirement got the current weights too
    assert 2 in {s["policy_replica"] for s in after}
    assert {round(s["policy_w"], 5) for s in after} == {round(trained, 5)}
    assert {s["policy_version"] for s in after} == {EPISODES}
    assert final.rollout.serving == {"policy": 2}
    assert flowrl_actor_names() == []  # the dead replica's actor too


def test_a_replica_that_died_in_a_shard_gets_no_later_sync_and_the_run_completes(ray_cluster):
    from ray.util.queue import Queue

    tokens = Queue(actor_options={"num_cpus": 0})
    tokens.put(True)  # replica 1 dies in its first shard
    engine = _engine(tokens, (1,), "host", in_shard=True)
    try:
        with engine:
            stats = engine.learn()
            trained = engine.train_results[-1]["trainer"][-1][0]["w_sum"]
            after = engine._portal.call(
                engine._session.deployment.rollout.run, [{"x": np.ones(4, dtype=np.float32)}] * 4
            )
        left_empty = tokens.empty()
    finally:
        tokens.shutdown()
    assert left_empty  # the death happened
    policy = stats.rollout.stages["policy.forward_step"]
    assert policy.samples == EPISODES * PER_EPISODE and policy.retried >= 1  # its shard ran again, counted once
    assert [e.weight_versions["policy"] for e in stats.episodes] == [1, 2, 3]  # every sync sent to replica 0 only
    assert stats.rollout.serving == {"policy": 1}
    assert {(s["policy_replica"], round(s["policy_w"], 5)) for s in after} == {(0, round(trained, 5))}
    assert flowrl_actor_names() == []


@pytest.mark.parametrize(
    "in_shard", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["in-set_weights", "in-a-shard"]
)
def test_a_dead_replica_is_replaced_by_one_that_gets_the_current_weights_before_any_shard(ray_cluster, in_shard):
    from ray.util.queue import Queue

    tokens = Queue(actor_options={"num_cpus": 0})
    tokens.put(True)  # replica 1 dies once: at the first sync, or in its first shard
    engine = _engine(tokens, (1,), "host", in_shard=in_shard, healing={})
    probe = [{"x": np.ones(4, dtype=np.float32)} for _ in range(8)]
    try:
        with engine:
            stats = engine.learn()
            trained = engine.train_results[-1]["trainer"][-1][0]["w_sum"]
            rollout = engine._session.deployment.rollout
            engine._portal.call(rollout.healed)
            serving = rollout.serving("policy")
            after = engine._portal.call(rollout.run, probe)
            events = rollout.scale_events
        left_empty = tokens.empty()
    finally:
        tokens.shutdown()
    assert left_empty  # the death happened
    assert serving == [0, 2]  # the pool is back at its size, with a new replica (ids are not reused)
    ((action, reason),) = [(e.action, e.reason) for e in events]
    assert action == "grow" and reason == "replaced replica 1, which died (1 in a row)"
    assert stats.rollout.stages["policy.forward_step"].samples == EPISODES * PER_EPISODE  # each sample once
    # whenever it joined, it computed with the weights the others hold: the trainer's last
    assert {s["policy_replica"] for s in after} == {0, 2}
    assert {round(s["policy_w"], 5) for s in after} == {round(trained, 5)}
    assert {s["policy_version"] for s in after} == {EPISODES}
    assert flowrl_actor_names() == []


def test_weights_sent_by_host_outlive_the_trainer_process_that_made_them(ray_cluster):
    """A replica that joins while its trainer's process is gone (killed, not yet rebuilt) still
    gets the weights the others hold: the driver owns them, not the trainer."""
    import ray
    from ray.exceptions import RayActorError

    engine = _engine(None, (), "host")
    probe = [{"x": np.ones(4, dtype=np.float32)} for _ in range(8)]
    with engine:
        engine.learn()
        trained = engine.train_results[-1]["trainer"][-1][0]["w_sum"]
        (rank,) = engine._session.deployment.trainers["trainer"]
        ray.kill(rank.ref, no_restart=True)
        with pytest.raises(RayActorError):  # the kill lands after the calls already on their way
            for _ in range(10_000):
                ray.get(rank.ref.ping.remote())
        assert engine.resize("policy", 3) == [2]  # a new replica, id 2
        rollout = engine._session.deployment.rollout
        after = engine._portal.call(rollout.run, probe)
        serving = rollout.serving("policy")
    assert serving == [0, 1, 2]
    assert {round(s["policy_w"], 5) for s in after} == {round(trained, 5)}
    assert {s["policy_version"] for s in after} == {EPISODES}
    assert flowrl_actor_names() == []


def test_after_a_survivor_rebuild_a_replica_joining_gets_the_weights_a_broadcast_sent(ray_cluster):
    """Weights broadcast (gloo here) are a snapshot in the trainer's rank 0. After a rebuild from a
    survivor the policy keeps what it holds, and ``rehome`` reads it back from a live replica, so a
    replica added once the old ranks are gone gets those weights instead of a dead snapshot."""
    import ray

    engine = _engine(None, (), "nccl")
    probe = [{"x": np.ones(4, dtype=np.float32)} for _ in range(8)]
    with engine:
        engine.learn()
        trained = engine.train_results[-1]["trainer"][-1][0]["w_sum"]
        session = engine._session
        assert isinstance(session.weights.sent("policy"), Broadcast)
        engine._portal.call(session.weights.rehome, "trainer")
        assert not isinstance(session.weights.sent("policy"), Broadcast)
        engine._portal.call(session.deployment.restart_trainer, engine.trainers[0])  # the old rank 0 goes
        assert engine.resize("policy", 3) == [2]
        rollout = session.deployment.rollout
        after = engine._portal.call(rollout.run, probe)
        serving = rollout.serving("policy")
        (joined,) = [h for h in session.deployment.replicas_of("policy") if h.replica_id == 2]
        held = ray.get(engine._portal.call(session.deployment.backend.get_weights, joined))
    assert serving == [0, 1, 2]
    assert round(float(held["weight"].sum()), 5) == round(trained, 5)  # the new replica's own weights
    assert {round(s["policy_w"], 5) for s in after} == {round(trained, 5)}
    assert flowrl_actor_names() == []


def test_when_every_replica_dies_in_set_weights_the_run_fails_naming_the_model(ray_cluster):
    from ray.util.queue import Queue

    tokens = Queue(actor_options={"num_cpus": 0})
    for _ in range(2):
        tokens.put(True)
    engine = _engine(tokens, (0, 1), "host")
    try:
        with pytest.raises(flowrl.ReplicaDiedError, match="every replica of model 'policy' has died") as info:
            with engine:
                engine.learn()
        left_empty = tokens.empty()
    finally:
        tokens.shutdown()
    assert left_empty  # both died
    assert info.value.stage == "policy.set_weights"
    assert flowrl_actor_names() == []


# ---- the broadcast sent again, on a scripted backend: a death in the middle of a collective
# (the others' loads fail too) cannot be placed deterministically on a real gloo group ----


class _Broken(StageError):
    pass


class _ScriptedBackend:
    """Broadcasts whose outcome per (group, replica) the test scripts; records each load."""

    def __init__(self, outcomes: dict[tuple[int, str], Exception]) -> None:
        self.outcomes, self.groups, self.loaded = outcomes, [], []

    async def serve_weights(self, rank: Any, world: int, backend: str, timeout_s: float) -> Group:
        group = Group(id=f"g{len(self.groups)}", address="", port=0, world=world, backend=backend, timeout_s=timeout_s)
        self.groups.append(group)
        return group

    async def send_weights(self, rank: Any, group: Group, snapshot: int, keep: list[str]) -> None:
        if (int(group.id[1:]), "trainer") in self.outcomes:
            raise self.outcomes[(int(group.id[1:]), "trainer")]

    async def load_weights(self, handle: ReplicaHandle, version: int, weights: Any) -> None:
        group = weights.group.id if isinstance(weights, Broadcast) and weights.group else "g-1"  # -1: by host
        failure = self.outcomes.get((int(group[1:]), handle.model + str(handle.replica_id)))
        if failure is not None:
            raise failure
        self.loaded.append((handle.replica_id, group, getattr(weights, "rank", 0), version))


class _Deployment:
    def __init__(self, backend: _ScriptedBackend, replicas: int) -> None:
        self.backend, self.members = backend, anyio.Lock()
        self.trainers = {"trainer": [ReplicaHandle("trainer", 0, "", object())]}
        self.live = [ReplicaHandle("policy", r, "", object()) for r in range(replicas)]
        self.retired: list[int] = []

    def replicas_of(self, model: str) -> list[ReplicaHandle]:
        return list(self.live)

    def retire(self, handle: ReplicaHandle, err: ReplicaDiedError) -> None:
        self.live.remove(handle)
        self.retired.append(handle.replica_id)
        if not self.live:
            raise ReplicaDiedError(f"{err.message}; every replica of model 'policy' has died", err.stage, -1, [])


def _sync(outcomes: dict[tuple[int, str], Exception], replicas: int = 3) -> tuple[WeightSync, _Deployment]:
    deployment = _Deployment(_ScriptedBackend(outcomes), replicas)
    pair = (flowrl.Model("trainer"), flowrl.Model("policy"))
    config = flowrl.RunConfig(sample_per_episode=8, collective_timeout_s=5.0)
    return WeightSync(config, [pair], deployment), deployment  # type: ignore[arg-type]


def _broadcast() -> Broadcast:
    return Broadcast(layout=[], sizes={}, backend="gloo", trainer="trainer", snapshot=0)


def _died(replica: int) -> ReplicaDiedError:
    return ReplicaDiedError("the replica's process died", "policy.set_weights", replica, [])


def test_a_broadcast_broken_by_a_death_is_sent_again_to_the_survivors_it_missed_in_a_new_group():
    broken = _Broken("RuntimeError: [gloo] Connection closed by peer", "policy.set_weights", 0, [])
    # group 0: replica 1 dies mid-broadcast; replica 0 and the trainer see the collective break;
    # replica 2 had received the weights already
    sync, deployment = _sync({(0, "policy1"): _died(1), (0, "policy0"): broken, (0, "trainer"): broken})

    async def main() -> None:
        await sync.send("policy", 1, _broadcast())
        assert deployment.retired == [1]
        assert sync.versions == {"policy": 1}
        assert "policy" not in sync.groups  # the failed broadcast's group is never used again
        await sync.send("policy", 2, _broadcast())  # the next sync: the survivors, in a group of their own

    anyio.run(main)
    groups = deployment.backend.groups
    assert [g.world for g in groups] == [4, 2, 3]  # all; replica 0 sent again; the survivors
    assert deployment.backend.loaded == [
        (2, "g0", 3, 1),
        (0, "g1", 1, 1),  # sent again, alone with the trainer
        (0, "g2", 1, 2),
        (2, "g2", 2, 2),
    ]
    assert sync.groups["policy"][1] is groups[2]


def test_a_failure_that_is_no_death_still_fails_the_sync():
    user = StageError("ValueError: bad shape", "policy.set_weights", 0, [])
    # one replica died, one raised; sent again, the one that raised raises again; by host, at once
    sync, deployment = _sync(
        {(0, "policy0"): user, (0, "policy1"): _died(1), (1, "policy0"): user, (-1, "policy0"): user}
    )

    async def main() -> None:
        with pytest.raises(StageError, match="bad shape"):
            await sync.send("policy", 1, _broadcast())
        with pytest.raises(StageError, match="bad shape"):
            await sync.send("policy", 2, {"w": np.zeros(1)})

    anyio.run(main)
    assert sync.versions == {"policy": -1}
    assert deployment.retired == [1]
    assert [g.world for g in deployment.backend.groups] == [4, 2]  # all; replica 0 again
    assert deployment.backend.loaded == [(2, "g0", 3, 1), (2, "g-1", 0, 2)]  # the one left without fault


def test_every_replica_dying_in_a_broadcast_fails_with_replica_died_error():
    sync, deployment = _sync({(0, "policy0"): _died(0), (0, "policy1"): _died(1)}, replicas=2)

    async def main() -> None:
        with pytest.raises(ReplicaDiedError, match="every replica of model 'policy' has died"):
            await sync.send("policy", 1, _broadcast())

    anyio.run(main)
    assert deployment.retired == [0, 1]
