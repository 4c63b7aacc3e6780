"""The ``Model`` base names a subclass that skipped ``super().__init__``, keeps ordinary
attribute errors ordinary, copies and pickles as before, and names an attribute that cannot be
copied to the replicas."""

from __future__ import annotations

import copy
import pickle
import threading
from typing import Any

import pytest

import flowrl
from flowrl._core.flow.model import mark_synced, weight_hooks_problem


class Forgetful(flowrl.Model):
    def __init__(self, name: str, temperature: float = 1.0) -> None:
        self.temperature = temperature  # and no super().__init__(name, ...)

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"y": [0] * len(batch)}


class Child(Forgetful):  # the __init__ that forgot is its parent's
    pass


class Fine(flowrl.Model):
    def __init__(self, name: str, config: Any = None) -> None:
        super().__init__(name, config)
        self.history: list[int] = [1, 2]

    def forward_step(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {"y": [0] * len(batch)}


def test_a_subclass_that_skips_super_init_is_named_when_the_flow_is_built():
    policy = Forgetful("policy")
    with pytest.raises(
        flowrl.FlowDefinitionError,
        match=r"Forgetful\.__init__ did not call super\(\)\.__init__\(name, config\): the flowrl\.Model part of "
        r"this Forgetful was never set up \(no attribute 'name'\); call super\(\)\.__init__\(name, config\) at the "
        r"start of Forgetful\.__init__",
    ):
        flowrl.run_flow(lambda x: policy.forward_step(x), [{"x": 1}], {"backend": "inprocess"})
    with pytest.raises(flowrl.FlowDefinitionError, match=r"Forgetful\.__init__ did not call .* this Child"):
        _ = Child("c").config
    assert repr(policy) == "<Forgetful, not initialised>"  # a repr (in a traceback, a debugger) never raises


def test_an_ordinary_missing_attribute_stays_an_ordinary_attribute_error():
    model = Fine("m")
    with pytest.raises(AttributeError) as info:
        _ = model.tokenizer
    assert type(info.value) is AttributeError and "'Fine' object has no attribute 'tokenizer'" in str(info.value)
    assert not hasattr(model, "module") and getattr(model, "module", None) is None
    # an uninitialised model still answers hasattr (its error is an AttributeError too)
    assert not hasattr(Forgetful("p"), "name")


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "copy"])
def test_a_model_copies_and_pickles_with_its_attributes(how):
    model = Fine("m", {"num_replicas": 2})
    clone = {
        "deepcopy": copy.deepcopy,
        "pickle": lambda m: pickle.loads(pickle.dumps(m)),
        "copy": copy.copy,
    }[how](model)
    assert type(clone) is Fine and vars(clone).keys() == vars(model).keys()
    assert (clone.name, clone.config, clone.num_replicas, clone.history) == ("m", model.config, 2, [1, 2])
    if how != "copy":  # a deep copy shares no mutable state with the driver's model
        clone.history.append(3)
        assert model.history == [1, 2]


def test_a_deep_copy_keeps_shared_references_shared():
    model = Fine("m")
    model.a = model.b = [0]
    model.me = model
    clone = copy.deepcopy(model)
    assert clone.a is clone.b and clone.me is clone


def test_an_attribute_that_cannot_be_copied_is_named_with_the_fix():
    model = Fine("policy")
    model.lock = threading.Lock()
    with pytest.raises(
        flowrl.ConfigError,
        match=r"model 'policy' \(Fine\) cannot be copied to its replicas: its attribute 'lock' \(lock\) cannot be "
        r"copied \(TypeError: .*\); build it in setup\(\), which runs inside each replica",
    ):
        copy.deepcopy(model)


class Loader(flowrl.Model):
    def set_weights(self, weights: Any) -> None:
        pass


def test_only_synced_models_must_expose_a_module_or_their_own_hook():
    trainer, policy, own = Fine("trainer"), Fine("policy"), Loader("own")
    mark_synced([trainer, policy, own], [(trainer, policy), (trainer, own)])
    assert "model 'trainer' sends weights to ['policy', 'own']" in str(weight_hooks_problem(trainer))
    assert "override get_weights() in Fine" in str(weight_hooks_problem(trainer))
    assert "model 'policy' receives weights from ['trainer']" in str(weight_hooks_problem(policy))
    assert weight_hooks_problem(own) is None  # loads its own way
    policy.module = object()  # not a torch module: no load_state_dict
    assert "self.module = object, without load_state_dict()" in str(weight_hooks_problem(policy))
    mark_synced([trainer, policy, own], [])  # another engine without syncs: the marks go
    assert weight_hooks_problem(trainer) is None and weight_hooks_problem(policy) is None
