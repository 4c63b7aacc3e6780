"""Flow tracing and build-time validation (sans-IO: no Ray, no event loop)."""

from __future__ import annotations

import pytest

import flowrl
from flowrl._core.flow.graph import SOURCE, trace


class Policy(flowrl.Model):
    def forward_step(self, batch, iteration):
        return {"response": [f"{q}!" for q in batch["query"]]}


class Echo(flowrl.Model):
    def forward_step(self, batch, iteration):
        return {f"{self.name}_out": list(batch["query"])}


class NoForward(flowrl.Model):
    def setup(self):
        pass


class Scorer(flowrl.Model):
    @flowrl.step
    def score(self, batch, iteration):
        return {"score": [len(r) for r in batch["response"]]}


def declared(reads=None, writes=None):
    """A model class whose forward_step declares ``reads`` and ``writes``."""

    class Declared(flowrl.Model):
        @flowrl.step(reads=reads, writes=writes)
        def forward_step(self, batch, iteration):
            return {}

    return Declared


def issue_flow():
    policy, reference, value, reward = (Echo(n) for n in ("policy", "reference", "value", "reward"))

    def flow(prompts):
        out = policy.forward_step(prompts)
        ref = reference.forward_step(out)
        val = value.forward_step(out)
        return reward.forward_step(out, ref, val)

    return flow, (policy, reference, value, reward)


def test_issue_flow_traces_into_four_stages():
    flow, models = issue_flow()
    graph = flowrl.build_flow(flow, input_fields=["query"])
    p, r, v, w = (f"{m.name}.forward_step" for m in models)
    assert list(graph.stages) == [p, r, v, w]
    assert graph.stages[p].inputs == (SOURCE,)
    assert graph.stages[r].inputs == (p,)
    assert graph.stages[v].inputs == (p,)
    assert graph.stages[w].inputs == (p, r, v)
    assert set(graph.inputs_of(w)) == {SOURCE, p, r, v}
    assert set(graph.inputs_of(r)) == {SOURCE, p}
    assert graph.outputs == (w,)
    assert {name: graph.models[name] for name in graph.models} == {m.name: m for m in models}
    assert all(graph.stages[s].method == "forward_step" for s in graph.stages)


def test_model_called_twice_gets_numbered_stages():
    m = Echo("m")
    graph = trace(lambda x: m.forward_step(m.forward_step(x)))
    assert list(graph.stages) == ["m.forward_step", "m.forward_step#2"]
    assert {graph.stages[s].model for s in graph.stages} == {"m"}
    assert graph.models == {"m": m}
    assert graph.stages_of("m") == ["m.forward_step", "m.forward_step#2"]
    assert graph.stages["m.forward_step#2"].inputs == ("m.forward_step",)


def test_fan_out_returns_a_tuple_of_outputs():
    a, b, c = Echo("a"), Echo("b"), Echo("c")

    def flow(x):
        y = a.forward_step(x)
        return b.forward_step(y), c.forward_step(y)

    graph = trace(flow)
    assert graph.outputs == ("b.forward_step", "c.forward_step")
    assert [s.name for s in graph.consumers("a.forward_step")] == ["b.forward_step", "c.forward_step"]
    assert set(graph.output_producers) == {SOURCE, "a.forward_step", "b.forward_step", "c.forward_step"}


def test_fan_in_joins_independent_branches():
    a, b, c = Echo("a"), Echo("b"), Echo("c")
    graph = trace(lambda x: c.forward_step(a.forward_step(x), b.forward_step(x)))
    assert graph.stages["c.forward_step"].inputs == ("a.forward_step", "b.forward_step")
    assert set(graph.inputs_of("c.forward_step")) == {SOURCE, "a.forward_step", "b.forward_step"}
    assert [s.name for s in graph.consumers(SOURCE)] == ["a.forward_step", "b.forward_step"]


def test_diamond_sees_shared_ancestor_once():
    a, b, c, d = Echo("a"), Echo("b"), Echo("c"), Echo("d")

    def flow(x):
        y = a.forward_step(x)
        return d.forward_step(b.forward_step(y), c.forward_step(y))

    graph = trace(flow)
    view = graph.inputs_of("d.forward_step")
    assert len(view) == len(set(view))
    assert set(view) == {SOURCE, "a.forward_step", "b.forward_step", "c.forward_step"}


def test_repeated_argument_is_one_input():
    m = Echo("m")
    graph = trace(lambda x: m.forward_step(x, x))
    assert graph.stages["m.forward_step"].inputs == (SOURCE,)


def test_custom_step_method_is_traced():
    p, s = Policy("policy"), Scorer("scorer")
    graph = trace(lambda x: s.score(p.forward_step(x)))
    assert graph.stages["scorer.score"].method == "score"
    assert graph.stages["scorer.score"].inputs == ("policy.forward_step",)


def _raises(flow, *needles):
    with pytest.raises(flowrl.FlowDefinitionError) as info:
        trace(flow)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    return info.value


def test_returning_a_non_node_is_an_error():
    m = Echo("m")

    def flow(x):
        m.forward_step(x)
        return {"not": "a stage"}

    _raises(flow, "must return", "not")


def test_flow_without_any_stage_is_an_error():
    _raises(lambda x: x, "calls no model step")


def test_non_callable_flow_is_an_error():
    _raises(42, "function", "int")


def test_non_node_argument_is_an_error():
    m = Echo("m")
    _raises(lambda x: m.forward_step(x, [1, 2, 3]), "m.forward_step", "argument 1", "list")


@pytest.mark.parametrize("call", ["kw_node", "kw_extra"])
def test_keyword_arguments_are_an_error(call):
    m = Echo("m")

    def flow(x):
        return m.forward_step(batch=x) if call == "kw_node" else m.forward_step(x, iteration=3)

    expected = "batch" if call == "kw_node" else "iteration"
    _raises(flow, "m.forward_step", "keyword", expected)


def test_two_models_with_the_same_name_are_an_error():
    first, second = Echo("twin"), Echo("twin")
    _raises(lambda x: second.forward_step(first.forward_step(x)), "'twin'", "unique")


def test_same_instance_twice_is_not_a_name_clash():
    m = Echo("twin")
    assert len(trace(lambda x: m.forward_step(m.forward_step(x))).stages) == 2


@pytest.mark.parametrize(
    "misuse",
    [
        lambda node: node["query"],
        lambda node: bool(node),
        lambda node: 1 if node else 0,
        lambda node: len(node),
        lambda node: list(node),
        lambda node: node.response,
    ],
    ids=["index", "bool", "if", "len", "iter", "attribute"],
)
def test_placeholder_used_as_data_is_an_error(misuse):
    m = Echo("m")

    def flow(x):
        out = m.forward_step(x)
        misuse(out)
        return out

    _raises(flow, "m.forward_step", "placeholder")


def test_step_a_class_does_not_define_is_an_error():
    m = NoForward("lazy")
    _raises(lambda x: m.forward_step(x), "lazy.forward_step", "NoForward")


def test_argument_from_another_flow_is_an_error():
    m, n = Echo("m"), Echo("n")
    leaked = []
    trace(lambda x: leaked.append(m.forward_step(x)) or leaked[0])
    _raises(lambda x: n.forward_step(x, leaked[0]), "n.forward_step", "different flow")


def test_step_with_real_data_runs_user_code():
    batch = flowrl.Batch([0, 1], {"query": ["a", "b"]})
    assert Policy("p").forward_step(batch, 0) == {"response": ["a!", "b!"]}
    assert Scorer("s").score({"response": ["xy", "z"]}, 0) == {"score": [2, 1]}
    with pytest.raises(NotImplementedError):
        NoForward("lazy").forward_step(batch, 0)


# ---- declared reads and writes ----


def declared_issue_flow(
    ref_writes=("ref_logprobs",), value_writes=("values",), reward_reads=None, policy_writes=("response",)
):
    policy = declared(reads=["query"], writes=policy_writes)("policy")
    reference = declared(reads=["response"], writes=ref_writes)("reference")
    value = declared(reads=["response"], writes=value_writes)("value")
    reads = reward_reads if reward_reads is not None else ["query", "response", "ref_logprobs", "values"]
    reward = declared(reads=reads, writes=["reward"])("reward")

    def flow(prompts):
        out = policy.forward_step(prompts)
        return reward.forward_step(out, reference.forward_step(out), value.forward_step(out))

    return flow


def test_valid_declarations_are_accepted():
    graph = flowrl.build_flow(declared_issue_flow(), input_fields=["query"])
    assert graph.stages["reward.forward_step"].reads == frozenset({"query", "response", "ref_logprobs", "values"})
    assert graph.stages["policy.forward_step"].writes == frozenset({"response"})


def test_read_nobody_writes_is_rejected_with_what_inputs_provide():
    flow = declared_issue_flow(reward_reads=["response", "advantages"])
    with pytest.raises(flowrl.FlowDefinitionError) as info:
        flowrl.build_flow(flow, input_fields=["query"])
    msg = str(info.value)
    assert "reward.forward_step" in msg and "advantages" in msg
    for provided in ("query", "response", "ref_logprobs", "values"):
        assert provided in msg


def test_read_of_an_input_field_not_given_is_rejected():
    with pytest.raises(flowrl.FlowDefinitionError, match="policy.forward_step"):
        flowrl.build_flow(declared_issue_flow(), input_fields=["prompt"])


def test_two_writers_of_a_field_seen_together_are_rejected():
    flow = declared_issue_flow(ref_writes=["logprobs"], value_writes=["logprobs"], reward_reads=["logprobs"])
    with pytest.raises(flowrl.FlowDefinitionError) as info:
        flowrl.build_flow(flow, input_fields=["query"])
    msg = str(info.value)
    assert "logprobs" in msg and "reference.forward_step" in msg and "value.forward_step" in msg


def test_stage_writing_an_input_field_is_rejected():
    flow = declared_issue_flow(policy_writes=["query", "response"])
    with pytest.raises(flowrl.FlowDefinitionError) as info:
        flowrl.build_flow(flow, input_fields=["query"])
    assert "query" in str(info.value) and "flow input" in str(info.value)


def test_reads_not_checked_when_an_upstream_is_undeclared():
    undeclared = Echo("policy")
    reward = declared(reads=["anything"], writes=["reward"])("reward")
    graph = flowrl.build_flow(lambda x: reward.forward_step(undeclared.forward_step(x)), input_fields=["query"])
    assert "reward.forward_step" in graph.stages


def test_reads_not_checked_when_input_fields_unknown():
    graph = flowrl.build_flow(declared_issue_flow(reward_reads=["nowhere"]), input_fields=None)
    assert len(graph.stages) == 4
