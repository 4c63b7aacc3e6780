"""Where a replica added to a running engine goes (``Placement.joined``): a replacement into the
placement bundle of the replica it replaces, a grow by its resources alone. Pure: no Ray."""

from __future__ import annotations

import pytest

import flowrl
from flowrl._engine.placement import Placement


class Plain(flowrl.Model):
    def forward_step(self, batch, iteration):
        return {}


def placement(colocate: bool) -> tuple[Placement, flowrl.Model, flowrl.Model]:
    policy = Plain("policy", {"num_replicas": 2, "gpus_per_replica": 1})
    scorer = Plain("scorer", {"num_replicas": 2, "gpus_per_replica": 1})
    config = flowrl.RunConfig(sample_per_episode=4, colocation=[["policy", "scorer"]] if colocate else [])
    return Placement(config, {"policy": policy, "scorer": scorer}), policy, scorer


@pytest.mark.parametrize("colocate", [False, True])
def test_a_replacement_takes_the_bundle_of_the_replica_it_replaces_and_so_does_its_own(colocate):
    where, policy, _ = placement(colocate)
    first = where.joined(policy, 2, replaces=1)  # replica 2 in place of 1
    again = where.joined(policy, 3, replaces=2)  # replica 3 in place of 2, which replaced 1
    original = where.spec(policy, 1)
    for spec, replica in ((first, 2), (again, 3)):
        assert spec.replica_id == replica
        assert spec.bundle == original.bundle and spec.bundle is not None
        assert (spec.num_gpus, spec.num_cpus) == (original.num_gpus, original.num_cpus)
    other = where.joined(policy, 4, replaces=0)
    assert other.bundle == where.spec(policy, 0).bundle != original.bundle


def test_the_evaluation_pool_s_replacements_keep_to_its_own_bundles():
    where, policy, _ = placement(False)
    evaluation = where.joined(policy, 2, replaces=1, pool="-eval")
    assert evaluation.bundle == where.spec(policy, 1, "-eval").bundle != where.spec(policy, 1).bundle


def test_a_grow_and_its_replacements_are_placed_by_their_resources_and_a_colocated_pool_cannot_grow():
    where, policy, _ = placement(False)
    grown = where.joined(policy, 2, replaces=None)
    assert grown.bundle is None and grown.num_gpus == 1
    for replica, replaces in ((3, 2), (4, 3)):  # outside the placement group, as the replica it replaces
        spec = where.joined(policy, replica, replaces=replaces)
        assert spec.bundle is None and spec.replica_id == replica and spec.num_gpus == 1
    where, policy, _ = placement(True)
    with pytest.raises(flowrl.ConfigError, match="colocated"):
        where.joined(policy, 2, replaces=None)
