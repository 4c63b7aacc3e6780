"""The run-file YAML bounds (depth, size, aliases) hold under both of PyYAML's parsers, libyaml's (C,
what flowrl uses where PyYAML has it) and PyYAML's own (Python, what it uses otherwise), and a refusal
reads the same under both: the message is flowrl's, not the installed libyaml's."""

from __future__ import annotations

import re

import pytest
import yaml

from flowrl._core.errors import ConfigError
from flowrl._core.settings.config_files import (
    MAX_CONFIG_BYTES,
    MAX_NESTING,
    MAX_YAML_NODES,
    parse_yaml,
    read_config_file,
)

WITH_LIBYAML = bool(getattr(yaml, "__with_libyaml__", False))
NO_LIBYAML = "PyYAML was built without libyaml: its C parser is not installed"
PARSERS = [pytest.param("libyaml", marks=pytest.mark.skipif(not WITH_LIBYAML, reason=NO_LIBYAML)), "python"]
DEEP = rf"deep\.yaml: not valid YAML: line \d+, column \d+: nested deeper than {MAX_NESTING} levels"


def flow(depth: int) -> str:
    """A value ``depth`` levels deep: ``depth - 1`` nested lists around a scalar."""
    return "[" * (depth - 1) + "1" + "]" * (depth - 1)


def block(depth: int) -> str:
    """A mapping ``depth`` levels deep, by indentation: ``depth - 1`` nested mappings around a null."""
    return "".join(f"{'  ' * i}k:\n" for i in range(depth - 1))


def bomb(levels: int) -> str:
    """The "billion laughs": each level a list of 9 aliases of the level below."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.fixture(params=PARSERS)
def parser(request):
    return request.param


@pytest.mark.parametrize("shape", [flow, block])
def test_nesting_loads_up_to_the_bound_and_is_refused_past_it(parser, shape):
    assert parse_yaml(shape(MAX_NESTING), "deep.yaml", parser=parser) is not None
    with pytest.raises(ConfigError, match=f"^{DEEP}$"):
        parse_yaml(shape(MAX_NESTING + 1), "deep.yaml", parser=parser)


@pytest.mark.parametrize("brackets", [1000, 5000, MAX_CONFIG_BYTES - 3], ids=["1000", "5000", "a-whole-file"])
def test_brackets_past_libyamls_own_bound_are_refused_in_flowrls_words(parser, brackets):
    # libyaml 0.2.6 (PyYAML 6.0.4's wheels) refuses 1000 levels itself, and its look-ahead meets that
    # before flowrl's composer meets MAX_NESTING; older libyaml and PyYAML's own parser have no such bound
    with pytest.raises(ConfigError, match=f"^{DEEP}$"):
        parse_yaml("a: " + "[" * brackets, "deep.yaml", parser=parser)


def test_aliases_are_refused_past_the_depth_bound_once_expanded(parser):
    half = MAX_NESTING // 2 + 1  # each half within the bound, the two together past it
    text = f"a: &a {flow(half)}\nb: {'[' * half}*a{']' * half}\n"
    with pytest.raises(ConfigError, match=f"nested deeper than {MAX_NESTING} levels once aliases expand"):
        parse_yaml(text, "deep.yaml", parser=parser)
    assert parse_yaml(f"a: &a {flow(half)}\nb: [*a]\n", "deep.yaml", parser=parser)["b"] == [
        parse_yaml(flow(half), "deep.yaml", parser=parser)
    ]


def test_nodes_are_counted_up_to_the_bound(parser):
    # a top-level list of n scalars is n + 1 nodes
    assert len(parse_yaml(f"[{', '.join(['1'] * (MAX_YAML_NODES - 1))}]", "big.yaml", parser=parser)) == (
        MAX_YAML_NODES - 1
    )
    with pytest.raises(ConfigError, match=f"big.yaml: not valid YAML: line 1, column \\d+: more than {MAX_YAML_NODES}"):
        parse_yaml(f"[{', '.join(['1'] * MAX_YAML_NODES)}]", "big.yaml", parser=parser)


def test_a_file_is_read_up_to_the_byte_bound(parser, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"a: 1\n#" + b"x" * (MAX_CONFIG_BYTES - 6))
    assert read_config_file(path, "a mapping", parser=parser) == {"a": 1}
    path.write_bytes(b"a: 1\n#" + b"x" * (MAX_CONFIG_BYTES - 5))
    with pytest.raises(ConfigError, match=f"run.yaml: larger than {MAX_CONFIG_BYTES} bytes"):
        read_config_file(path, "a mapping", parser=parser)


def test_the_alias_bomb_and_the_alias_cycle_are_refused(parser):
    with pytest.raises(ConfigError, match=f"line 5, column 5: aliases expand to more than {MAX_YAML_NODES} nodes"):
        parse_yaml(bomb(9), "bomb.yaml", parser=parser)
    with pytest.raises(ConfigError, match="line 1, column 4: an alias refers to a node that contains it"):
        parse_yaml("a: &x [*x]\n", "cycle.yaml", parser=parser)
    # below the bound, aliases and merge keys load, each alias its anchor's value
    value = parse_yaml(bomb(4) + "m: &m {k: 1, j: 2}\nn: {<<: *m, j: 3}\n", "ok.yaml", parser=parser)
    assert value["a3"] == [[[["x"] * 9] * 9] * 9] * 9 and value["n"] == {"k": 1, "j": 3}


@pytest.mark.parametrize(
    "text",
    [
        "a: " + "[" * 5000,
        "a: " + "{a: " * 2000,
        block(MAX_NESTING + 1),
        f"[{', '.join(['1'] * MAX_YAML_NODES)}]",
        bomb(9),
        "a: [1, 2\nb: 3\n",
        "a: b: c\n",
        "a: 1\n\x01",
        "a: 1\na: [1, 2]]\n",
        "a: *nowhere\n",
    ],
    ids=["brackets", "braces", "block", "nodes", "bomb", "unclosed", "nested-plain", "control", "extra-close", "alias"],
)
@pytest.mark.skipif(not WITH_LIBYAML, reason=NO_LIBYAML)
def test_a_refusal_reads_the_same_under_both_parsers(text):
    refusals = []
    for parser in ("libyaml", "python"):
        with pytest.raises(ConfigError) as info:
            parse_yaml(text, "run.yaml", parser=parser)
        refusals.append(str(info.value))
    assert refusals[0] == refusals[1] and refusals[0].startswith("run.yaml: not valid YAML: "), refusals


@pytest.mark.skipif(not WITH_LIBYAML, reason=NO_LIBYAML)
def test_what_libyaml_refuses_stays_refused_where_pythons_parser_is_laxer():
    # flowrl accepts what libyaml accepts (tests/tools/test_fuzz_run_file.py checks it against
    # yaml.CSafeLoader): asking PyYAML's parser why libyaml refused must not let the text through
    text = "a: |\n  \tx\n"  # a tab in a literal block's indentation: libyaml refuses, PyYAML reads it as text
    try:
        yaml.load(text, Loader=yaml.CSafeLoader)
    except yaml.YAMLError:
        pass
    else:
        pytest.skip("this libyaml accepts a tab in a literal block's indentation")
    assert parse_yaml(text, "tab.yaml", parser="python") == {"a": "\tx\n"}
    with pytest.raises(ConfigError, match=re.escape("tab.yaml: not valid YAML: line ")):
        parse_yaml(text, "tab.yaml", parser="libyaml")
