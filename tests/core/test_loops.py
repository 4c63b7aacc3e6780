"""Tracing flowrl.loop (sans-IO): the loop's spec, the views of its stages, and every misuse
refused when the flow is built, naming the loop and the step."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import flowrl
from flowrl._core.flow.graph import SOURCE, trace
from flowrl._core.flow.loops import flags


class M(flowrl.Model):
    @flowrl.step
    def act(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {}

    @flowrl.step(writes=["text", "done"])
    def update(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {}

    @flowrl.step(writes=["move"])
    def move(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {}


policy, env, reward, other = M("policy"), M("env"), M("reward"), M("other")


def test_a_loop_is_traced_with_its_body_entry_result_and_exit():
    def flow(x):
        first = other.act(x)
        final = flowrl.loop(lambda s: env.act(policy.act(s)), first, until="done", max_turns=4, deadline_s=2)
        return reward.act(final)

    graph = trace(flow)
    spec = graph.loops["loop"]
    assert (spec.entry, spec.body, spec.result) == ("other.act", ("policy.act", "env.act"), "env.act")
    assert (spec.until, spec.max_turns, spec.deadline_s) == ("done", 4, 2.0)
    assert graph.stages["policy.act"].inputs == ("other.act",)  # the state placeholder is the entry
    assert graph.stages["reward.act"].inputs == ("loop:out",)
    assert graph.visible("loop:out") == (SOURCE, "other.act", "policy.act", "env.act")
    assert graph.inputs_of("reward.act") == (SOURCE, "other.act", "policy.act", "env.act")
    assert [s.name for s in graph.turn_starts(spec)] == ["policy.act"]
    assert graph.loops_seen("reward.act") == (spec,) and graph.loops_seen("other.act") == ()
    assert graph.visits == 5  # four stages and one loop


def test_a_loop_can_be_the_flow_output_and_loop_on_the_input():
    graph = trace(lambda x: flowrl.loop(policy.act, x, until="done", max_turns=2, name="segment"))
    assert graph.outputs == ("segment:out",)
    assert graph.output_producers == (SOURCE, "policy.act")
    assert graph.loops["segment"].entry == SOURCE
    assert graph.loops_seen("") == (graph.loops["segment"],)


def test_declared_updates_of_the_state_are_not_two_writers():
    def flow(x):
        state = other.update(x)  # writes text and done
        return flowrl.loop(lambda s: env.update(policy.move(s)), state, until="done", max_turns=2)

    trace(flow).validate(["prompt"])  # env updates text and done inside the loop: allowed


def test_two_declared_writers_of_a_turn_field_are_refused():
    def flow(x):
        return flowrl.loop(lambda s: policy.update(env.move(other.move(s))), x, until="done", max_turns=2)

    with pytest.raises(flowrl.FlowDefinitionError, match=r"field 'move' is written by both"):
        trace(flow).validate(["text"])


@pytest.mark.parametrize(
    "flow, message",
    [
        (
            lambda x: flowrl.loop(lambda s: env.act(policy.act(s), x), x, until="done", max_turns=2),
            r"env.act: argument 1 comes from outside the body of loop 'loop'",
        ),
        (
            lambda x: flowrl.loop(
                lambda s: flowrl.loop(policy.act, s, until="done", max_turns=2, name="inner"),
                x,
                until="done",
                max_turns=2,
            ),
            r"flowrl.loop 'inner' is inside loop 'loop': loops do not nest",
        ),
        (
            lambda x: flowrl.loop(lambda s: s, x, until="done", max_turns=2),
            r"the body of loop 'loop' must return the output of a step called inside it",
        ),
        (
            lambda x: flowrl.loop(lambda s: (env.act(s), policy.act(s))[1], x, until="done", max_turns=2),
            r"loop 'loop': step\(s\) \['env.act'\] of the body do not lead to the step it returns",
        ),
        (
            lambda x: flowrl.loop(policy.act, flowrl.loop(env.act, x, until="d", max_turns=1), until="d", max_turns=1),
            r"two loops are named 'loop'",
        ),
        (lambda x: flowrl.loop(policy.act, x, until="", max_turns=2), r"until=...\) must name a boolean field"),
        (lambda x: flowrl.loop(policy.act, x, until="d", max_turns=0), r"max_turns=...\) must be an int >= 1"),
        (lambda x: flowrl.loop(policy.act, x, until="d", max_turns=True), r"max_turns=...\) must be an int >= 1"),
        (
            lambda x: flowrl.loop(policy.act, x, until="d", max_turns=2, deadline_s=0),
            r"deadline_s=...\) must be a positive number or None",
        ),
        (lambda x: flowrl.loop(policy.act, x, until="d", max_turns=2, name="a.b"), r"name=...\) must be 1 to 128"),
        (lambda x: flowrl.loop(policy.act, [x], until="d", max_turns=2), r"state must be the flow input or a stage"),
        (lambda x: flowrl.loop(3, x, until="d", max_turns=2), r"body must be a function of the loop's state"),
    ],
    ids=[
        "reads-outside",
        "nested",
        "returns-state",
        "stray-step",
        "same-name",
        "until",
        "max-turns",
        "max-turns-bool",
        "deadline",
        "name",
        "state",
        "body",
    ],
)
def test_misused_loops_are_refused_when_the_flow_is_traced(flow, message):
    with pytest.raises(flowrl.FlowDefinitionError, match=message):
        trace(flow)


def test_a_step_inside_a_loop_cannot_be_read_after_it():
    inside: list[Any] = []

    def body(s):
        inside.append(policy.act(s))
        return env.act(inside[-1])

    def flow(x):
        flowrl.loop(body, x, until="done", max_turns=2)
        return reward.act(inside[0])

    with pytest.raises(flowrl.FlowDefinitionError, match=r"argument 0 is a step inside loop 'loop'; after the loop"):
        trace(flow)


@pytest.mark.parametrize(
    "value, expected",
    [
        ([True, False], [True, False]),
        ([1, 0], [True, False]),
        (np.array([True, False]), [True, False]),
        (torch.tensor([[1], [0]]), [True, False]),
        ([np.bool_(True), np.int64(0)], [True, False]),
        (["yes", "no"], None),
        ([True], None),
        ("ab", None),
    ],
)
def test_until_values_are_read_as_one_boolean_per_row(value, expected):
    assert flags(value, 2) == expected


@pytest.mark.parametrize(
    "value, reference, expected",
    [
        ([1, 2], np.array([0, 0]), np.array([1, 2])),
        ([1.5, 2.0], np.array([0.0, 0.0], dtype=np.float32), np.array([1.5, 2.0], dtype=np.float32)),
        ([1, 2], np.array([0.0, 0.0]), np.array([1.0, 2.0])),
        (np.array([[1, 2], [3, 4]]), [[0], [0]], [np.array([1, 2]), np.array([3, 4])]),
        ([[1, 2], [3, 4]], torch.zeros(2, 2), torch.tensor([[1.0, 2.0], [3.0, 4.0]])),
    ],
    ids=["ints-to-int64", "floats-to-float32", "ints-to-float64", "array-to-list", "lists-to-tensor"],
)
def test_an_update_of_the_state_keeps_the_type_the_input_gave_it(value, reference, expected):
    from flowrl._core.flow.columns import like, signature

    out = like("x", value, reference)
    assert signature(out) == signature(reference)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(out, expected, strict=True))


@pytest.mark.parametrize(
    "value, reference, message",
    [
        ([1.5, 2.0], np.array([0, 0]), r"field 'x' is part of the loop's state.*int64 numpy array.*without loss"),
        ([[1, 2], [3, 4]], np.array([0, 0]), r"rows of shape \[2\]: a field keeps its trailing shape"),
        ([0.5, 1.0], torch.zeros(2, dtype=torch.long), r"int64 tensor.*without loss"),
    ],
    ids=["floats-for-ints", "shape", "floats-for-a-long-tensor"],
)
def test_an_update_that_would_lose_something_is_refused(value, reference, message):
    from flowrl._core.flow.columns import like

    with pytest.raises(flowrl.FlowDefinitionError, match=message):
        like("x", value, reference)


class Declared(flowrl.Model):
    @flowrl.step(writes=["text", "done"])
    def update(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {}

    @flowrl.step(reads=["loop_turns", "loop_stop"], writes=["reward"])
    def score(self, batch: flowrl.Batch, iteration: int) -> dict[str, Any]:
        return {}


def test_two_loops_in_a_row_may_declare_the_same_state_fields_and_a_step_after_may_read_the_record():
    a, b, r = Declared("a"), Declared("b"), Declared("r")

    def flow(x):
        first = flowrl.loop(a.update, x, until="done", max_turns=2, name="one")
        second = flowrl.loop(b.update, first, until="done", max_turns=2)
        return r.score(second)

    trace(flow).validate(["text", "done"])  # b updates what a updated; r reads the loop's record


def test_a_loops_state_used_after_the_loop_is_refused():
    states: list[Any] = []

    def body(s):
        states.append(s)
        return policy.act(s)

    def flow(x):
        flowrl.loop(body, x, until="done", max_turns=2)
        return env.act(states[0])

    with pytest.raises(flowrl.FlowDefinitionError, match=r"argument 0 is the state of loop 'loop', which exists only"):
        trace(flow)
