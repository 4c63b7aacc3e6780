"""A model Ray cannot send to its replicas (state made in ``__init__`` that does not pickle) is
refused before any actor starts, naming the model and the attribute, on a real Ray cluster."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import flowrl
from flowrl.testing import CountingTrainer, Scale, flowrl_actor_names


class Locked(Scale):
    def __init__(self, name: str, holder: str, value: Any) -> None:
        super().__init__(name, {"batch_size": 2}, srcs=["x"], dst="y")
        setattr(self, holder, value)


class Unshippable(Scale):
    """Fails as a whole, with every attribute fine on its own."""

    def __reduce__(self) -> Any:
        raise TypeError("this model refuses to be pickled")


def _items(n: int = 4) -> list[dict[str, Any]]:
    return [{"x": np.full(2, float(i))} for i in range(n)]


@pytest.fixture
def open_file(tmp_path):
    with open(tmp_path / "log.txt", "w") as f:
        yield f


@pytest.mark.parametrize(
    ("holder", "make", "kind"),
    [
        ("lock", lambda f: threading.Lock(), r"lock"),
        ("log", lambda f: f, r"TextIOWrapper"),
        ("parts", lambda f: {"ok": 1, "guard": threading.RLock()}, r"dict"),
    ],
    ids=["lock", "open-file", "nested-in-a-dict"],
)
def test_a_pipeline_model_that_cannot_be_pickled_is_named_before_any_actor_starts(
    ray_cluster, open_file, holder, make, kind
):
    model = Locked("policy", holder, make(open_file))
    with pytest.raises(
        flowrl.ConfigError,
        match=rf"model 'policy' \(Locked\) cannot be sent to its replicas: its attribute {holder!r} \({kind}\) "
        r"cannot be pickled \(.*\); build it in setup\(\), which runs inside each replica",
    ):
        flowrl.run_flow(lambda x: model.forward_step(x), _items(), {"backend": "ray"})
    assert flowrl_actor_names() == []


def test_a_model_that_fails_to_pickle_as_a_whole_is_named_without_an_attribute(ray_cluster):
    model = Unshippable("policy", {"batch_size": 2}, srcs=["x"], dst="y")
    with pytest.raises(
        flowrl.ConfigError,
        match=r"model 'policy' \(Unshippable\) cannot be sent to its replicas: it cannot be pickled "
        r"\(TypeError: this model refuses to be pickled\); build it in setup\(\)",
    ):
        flowrl.run_flow(lambda x: model.forward_step(x), _items(), {"backend": "ray"})
    assert flowrl_actor_names() == []


class LockedTrainer(CountingTrainer):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.guard = threading.Lock()


def test_an_engine_trainer_that_cannot_be_pickled_stops_the_engine_before_any_actor_starts(ray_cluster):
    policy = Scale("policy", {"num_replicas": 2, "batch_size": 2}, srcs=["x"], dst="y")
    engine = flowrl.Engine(
        rollout=lambda x: policy.forward_step(x),
        train=[LockedTrainer("trainer")],
        config={"sample_per_episode": 4, "train_global_batch_size": 4},
    )
    engine.set_dataset(_items(8))
    with pytest.raises(flowrl.ConfigError, match=r"model 'trainer' \(LockedTrainer\).*its attribute 'guard' \(lock\)"):
        engine.learn()
    assert flowrl_actor_names() == []


def test_a_picklable_model_runs_after_the_check(ray_cluster):
    model = Scale("policy", {"batch_size": 2}, srcs=["x"], dst="y")
    samples, _ = flowrl.run_flow(lambda x: model.forward_step(x), _items(), {"backend": "ray"})
    assert [list(s["y"]) for s in samples] == [[float(i)] * 2 for i in range(4)]
    assert flowrl_actor_names() == []
