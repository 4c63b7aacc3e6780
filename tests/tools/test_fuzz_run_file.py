"""Fuzzing the run-file loader (hypothesis; the "ci" profile of conftest.py: fixed seed, 300 cases a
test; FLOWRL_FUZZ=long for 20,000). Every case is a correct load or a FlowError: never another
exception, a hang, or a result that expands past the loader's bound.

"Correct" is checked against libyaml's own safe loader (the same parser, with a C composer and no
bounds): whatever the bounded loader returns, yaml.CSafeLoader returns too, and whatever it refuses
as malformed, yaml.CSafeLoader refuses as well."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from flowrl._core.errors import ConfigError, FlowError
from flowrl._core.settings.config import to_config
from flowrl._core.settings.config_files import MAX_NESTING, MAX_YAML_NODES, override_value, parse_yaml
from flowrl._core.settings.run_config import RunConfig
from flowrl._tools.run_file import load_run_file

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = (ROOT / "examples" / "ppo_tiny.yaml").read_bytes()
EXAMPLE_TOML = b"""flow = "rlhf"
dataset = "examples.ppo_tiny:dataset"
[models.policy]
class = "examples.ppo_tiny:Policy"
num_replicas = 2
args = {}
[run]
sample_per_episode = 64
num_episode = 30
colocation = [["policy", "reference"]]
"""
# the loader refuses these, by design, before it builds anything
BOUNDS = ("aliases expand to more than", "nested deeper than", f"more than {MAX_YAML_NODES} nodes", "contains it")
# pieces of YAML and TOML syntax the mutations splice in (anchors, aliases, merges, tags, nesting, odd bytes)
TOKENS = [
    b"&a ", b"*a", b"&b ", b"*b", b"<<: *a", b"[", b"]", b"{", b"}", b": ", b"\n", b"\n  ", b"- ", b"? ", b",",
    b"!!binary ", b"!!float ", b"!!int ", b"!!set ", b"!!python/object:os.system ", b"!!timestamp ", b"'", b'"',
    b'"""', b"\\", b"#", b"%YAML 1.1\n", b"---\n", b"...\n", b"|", b">", b"\t", b"\x00", b"\xff", b"\xef\xbb\xbf",
    b"\xc3", b"1e999", b".nan", b"-.inf", b"2001-13-01", b"1979-05-27T07:32:00Z", b"0x", b"=", b"[[", b"]]",
    b"inf", b"nan", b"9" * 30, b"[a.b]", b"[[x]]", b"a.b.c = 1\n", b"class", b"args", b"models", b"run",
]  # fmt: skip


def expanded_size(value: object, cap: int) -> int:
    """Nodes of ``value`` once every shared reference is counted again (what a copy or check walks)."""
    count, stack = 0, [value]
    while stack and count <= cap:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            for k, v in item.items():
                stack += [k, v]
        elif isinstance(item, list):
            stack += item
    return count


def check_yaml(text: str) -> None:
    """The bounded loader on ``text`` against libyaml's unbounded safe loader."""
    try:
        value = parse_yaml(text, "fuzz.yaml")
    except ConfigError as err:
        if any(bound in str(err) for bound in BOUNDS):
            return  # the reference might expand a bomb: not asked
        with pytest.raises((yaml.YAMLError, ValueError, TypeError, KeyError, IndexError, AttributeError)):
            yaml.load(text, Loader=yaml.CSafeLoader)
        return
    assert expanded_size(value, MAX_YAML_NODES) <= MAX_YAML_NODES
    assert repr(value) == repr(yaml.load(text, Loader=yaml.CSafeLoader))  # repr: NaN equals itself


def mutate(base: bytes, edits: list[tuple[int, float, int, bytes]]) -> bytes:
    data = bytearray(base)
    for op, where, length, piece in edits:
        at = int(where * len(data))
        if op == 0:  # delete a range
            del data[at : at + length]
        elif op == 1:  # insert a piece of syntax
            data[at:at] = piece
        elif op == 2:  # duplicate a range (lines, anchors, keys)
            data[at:at] = data[at : at + length]
        else:  # overwrite one byte
            data[at : at + 1] = piece[:1]
    return bytes(data)


EDITS = st.lists(
    st.tuples(
        st.integers(0, 3),
        st.floats(0, 1),
        st.integers(0, 64),
        st.sampled_from(TOKENS) | st.binary(min_size=1, max_size=8),
    ),
    min_size=1,
    max_size=12,
)


def check_run_file(folder: Path, content: bytes, suffix: str) -> None:
    """``flowrl run``'s loading on a file: a RunFile and RunConfig, or a FlowError naming the file."""
    path = folder / f"run{suffix}"
    path.write_bytes(content)
    try:
        spec = load_run_file(path)
        to_config(RunConfig, spec.run, "run")
    except FlowError:
        pass
    try:
        RunConfig.load(path)
    except FlowError:
        pass


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz_run_file")


@given(edits=EDITS, suffix=st.sampled_from([".yaml", ".toml"]))
def test_mutated_examples_load_or_raise_a_flow_error(folder, edits, suffix):
    base = EXAMPLE if suffix == ".yaml" else EXAMPLE_TOML
    content = mutate(base, edits)
    check_run_file(folder, content, suffix)
    if suffix == ".yaml":
        try:
            text = content.decode("utf-8-sig")
        except UnicodeDecodeError:
            return
        check_yaml(text)


@given(
    content=st.binary(max_size=400) | st.text(max_size=400).map(str.encode), suffix=st.sampled_from([".yml", ".toml"])
)
def test_random_bytes_load_or_raise_a_flow_error(folder, content, suffix):
    check_run_file(folder, content, suffix)


@given(st.lists(st.sampled_from([t.decode("latin-1") for t in TOKENS]) | st.text(max_size=4), max_size=40))
def test_random_yaml_token_soup_agrees_with_libyaml(pieces):
    check_yaml("".join(pieces))


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=40,
)


@given(data=JSONISH, flow=st.booleans())
def test_dumped_data_loads_back(data, flow):
    check_yaml(yaml.safe_dump({"run": data}, default_flow_style=flow))


@given(levels=st.integers(1, 12), fanout=st.integers(1, 12), merge=st.booleans(), cycle=st.booleans())
def test_alias_structures_load_exactly_or_are_refused_past_the_bound(levels, fanout, merge, cycle):
    lines = [f"a0: &a0 [{', '.join(['x'] * fanout)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * fanout)}]" for i in range(1, levels)]
    if merge:
        lines += ["m: &m {k: *a0}", "n: {<<: *m, j: 1}"]
    if cycle:
        lines += ["c: &c [1, *c]"]
    text = "\n".join(lines) + "\n"
    size = 1 + fanout  # level 0: the list and its scalars
    nodes = 1 + 1 + size  # the top mapping, the key a0 and its list
    for _ in range(1, levels):
        size = 1 + fanout * size
        nodes += 1 + size
    if merge:
        nodes += 1 + 1 + (1 + 1 + (1 + fanout)) + 1 + 1 + (1 + 2 + 2)
    if cycle:  # found when the walk reaches it: after the expansion bound if that is passed first
        refusal = "contains it" if nodes <= MAX_YAML_NODES else "contains it|aliases expand"
        with pytest.raises(ConfigError, match=refusal):
            parse_yaml(text, "aliases.yaml")
    elif nodes > MAX_YAML_NODES:
        with pytest.raises(ConfigError, match=f"aliases expand to more than {MAX_YAML_NODES} nodes"):
            parse_yaml(text, "aliases.yaml")
    else:
        value = parse_yaml(text, "aliases.yaml")
        expected: object = ["x"] * fanout
        for _ in range(1, levels):
            expected = [expected] * fanout
        assert value[f"a{levels - 1}"] == expected
        if merge:
            assert value["n"] == {"k": ["x"] * fanout, "j": 1}


@given(depth=st.integers(1, 3 * MAX_NESTING), flow=st.booleans())
def test_nesting_loads_up_to_the_bound_and_is_refused_past_it(depth, flow):
    text = "[" * (depth - 1) + "1" + "]" * (depth - 1) if flow else "".join(f"{'  ' * i}k:\n" for i in range(depth - 1))
    if depth > MAX_NESTING:
        with pytest.raises(ConfigError, match=f"nested deeper than {MAX_NESTING} levels"):
            parse_yaml(text, "deep.yaml")
    else:
        check_yaml(text)


@given(number=st.integers() | st.floats(allow_nan=False, allow_infinity=False))
def test_set_reads_every_finite_number_back_exactly(number):
    assert override_value("run.k", repr(number)) == number


@given(raw=st.text(max_size=40))
def test_set_values_are_a_value_or_a_config_error(raw):
    try:
        value = override_value("run.k", raw)
    except ConfigError as err:
        assert "override run.k=" in str(err)
        return
    assert expanded_size(value, MAX_YAML_NODES) <= MAX_YAML_NODES
