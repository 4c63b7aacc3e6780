"""Reading config and run files (YAML, TOML) and ``key=value`` overrides, bounded: a hostile or
corrupt file fails fast with a ``ConfigError`` naming it, never with another exception, a hang
or unbounded memory."""

from __future__ import annotations

import functools
import math
import re
import tomllib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from ..errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path


def deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def apply_override(data: dict[str, Any], item: str) -> None:
    """``a.b=c``: numbers are read strictly, other values as YAML (booleans, lists), else kept as text."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. num_episode=4 or models.policy.batch_size=8")
    value = override_value(key, raw)
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    node[leaf] = value


# ---- reading run files: bounded, so that a hostile or corrupt file fails fast with a ConfigError ----

# A run file is a page of keys (examples/ppo_tiny.yaml is 1 KiB). Past 1 MiB it is a mistake
# (a checkpoint or a dataset given as CONFIG) or an attack, and pure-Python YAML takes seconds a MiB.
MAX_CONFIG_BYTES = 1 << 20
# Nesting beyond this is no configuration; the YAML composer and tomllib recurse once a level.
MAX_NESTING = 64
# Nodes after aliases are expanded: a few hundred bytes of nested aliases ("billion laughs")
# otherwise expand to 10**9 nodes when the mapping is checked or copied.
MAX_YAML_NODES = 50_000
SUFFIXES = (".yaml", ".yml", ".toml")
# PyYAML's two parsers: libyaml's (C), the default where PyYAML was built with it, or its own (Python)
YamlParser = Literal["libyaml", "python"]
# what reads as a number: the strict parse below refuses a malformed one instead of keeping it as text
_NUMBER = re.compile(
    r"[+-]?(0[xob][0-9a-f_]*|(\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(e[+-]?[\d_]*)?|\.?nan|\.?inf|infinity)", re.I
)


def read_config_file(path: Path, expected: str, *, parser: YamlParser | None = None) -> dict[str, Any]:
    """The mapping a ``.yaml``/``.yml``/``.toml`` file holds; every failure a ConfigError naming ``path``.
    ``parser`` is for tests, as in ``parse_yaml``."""
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"{path}: expected a .yaml, .yml or .toml file")
    text = _read_text(path)
    if path.suffix == ".toml":
        data = _parse_toml(text, path)
    else:
        data = parse_yaml(text, str(path), parser=parser)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be {expected}, got {type(data).__name__}")
    return deep_copy(data)


def _read_text(path: Path) -> str:
    if not path.exists():
        raise ConfigError(f"{path}: no such file")
    if not path.is_file():  # a folder, a FIFO (reading one would block), a device
        raise ConfigError(f"{path}: not a regular file")
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({type(err).__name__}: {err.strerror or err})") from err
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; a run file is a page of keys")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}: {err.reason})") from err


def _parse_toml(text: str, path: Path) -> Any:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from err
    except RecursionError as err:  # tomllib recurses once per nested array or inline table
        raise ConfigError(f"{path}: nested deeper than {MAX_NESTING} levels") from err
    except ValueError as err:  # an integer past Python's digit limit (int_max_str_digits)
        raise ConfigError(f"{path}: not valid TOML: {err}") from err
    if _depth(data) > MAX_NESTING:
        raise ConfigError(f"{path}: nested deeper than {MAX_NESTING} levels")
    return data


def _depth(data: Any) -> int:
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, level = stack.pop()
        deepest = max(deepest, level)
        if isinstance(value, Mapping):
            stack.extend((v, level + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, level + 1) for v in value)
    return deepest


def parse_yaml(text: str, where: str, *, parser: YamlParser | None = None) -> Any:
    """``text`` as YAML by a safe loader with bounded nesting, no alias cycles and a bounded expanded size.
    ``parser`` picks PyYAML's parser (None: libyaml's where PyYAML has it); tests check the bounds under both."""
    import yaml

    try:
        return _load_yaml(text, parser or ("libyaml" if getattr(yaml, "__with_libyaml__", False) else "python"))
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{where}: not valid YAML: {at}{err.problem or err.context}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {err}") from err
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as err:
        # the safe constructor trusts the resolver's patterns: a date 2001-13-01, or an explicit tag on a value
        # it does not fit (!!float with no value, !!bool maybe, !!timestamp x) fails inside PyYAML
        raise ConfigError(
            f"{where}: not valid YAML: a value that does not fit its type ({type(err).__name__}: {err})"
        ) from err


def _load_yaml(text: str, parser: YamlParser) -> Any:
    from yaml.parser import ParserError
    from yaml.reader import ReaderError
    from yaml.scanner import ScannerError

    loader = _bounded_loader(parser)(text)
    try:
        return loader.get_single_data()
    except (ReaderError, ScannerError, ParserError):
        # libyaml 0.2.6 (PyYAML 6.0.4's wheels) has a nesting bound of its own, 1000, that its look-ahead
        # (1024 characters, for a key) meets in a run of brackets before flowrl's composer meets MAX_NESTING;
        # PyYAML's parser has none. So a refusal is asked of PyYAML's parser again and reads in flowrl's
        # words on every install. Where libyaml alone refuses (it is stricter here and there), that parser
        # loads the text and libyaml's refusal stands: what loads is what libyaml loads. Only refusals pay.
        if parser == "libyaml":
            _load_yaml(text, "python")
        raise
    finally:
        loader.dispose()


@functools.cache
def _bounded_loader(parser: YamlParser) -> type[Any]:
    import yaml
    from yaml.composer import Composer
    from yaml.constructor import SafeConstructor
    from yaml.resolver import Resolver

    class Bounded(Composer):
        """Counts nodes and nesting while composing, checks the expanded graph before constructing."""

        level = composed = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            self.level += 1
            self.composed += 1
            try:
                if self.level > MAX_NESTING:
                    raise _refused(self, f"nested deeper than {MAX_NESTING} levels")
                if self.composed > MAX_YAML_NODES:
                    raise _refused(self, f"more than {MAX_YAML_NODES} nodes")
                return super().compose_node(parent, index)
            finally:
                self.level -= 1

        def get_single_data(self) -> Any:
            node = self.get_single_node()
            if node is None:
                return None
            _check_expansion(node)
            return self.construct_document(node)  # type: ignore[attr-defined]

    if parser == "python":
        return type("BoundedLoader", (Bounded, yaml.SafeLoader), {})
    from yaml.cyaml import CParser  # type: ignore[attr-defined]  # not in the stubs

    # libyaml's parser (C, iterative) is 7x faster than PyYAML's; the composer stays PyYAML's
    # (Python, above), so that the bounds apply to it
    class BoundedLoader(Bounded, CParser, SafeConstructor, Resolver):
        def __init__(self, stream: str) -> None:
            CParser.__init__(self, stream)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

    return BoundedLoader


def _refused(loader: Any, problem: str) -> Exception:
    import yaml

    mark = loader.peek_event().start_mark if loader.check_event() else None
    return yaml.MarkedYAMLError(problem=problem, problem_mark=mark)


def _check_expansion(root: Any) -> None:
    """Expanded size and depth of the node graph (aliases repeat a node), each node visited once."""
    import yaml

    sizes: dict[int, tuple[int, int]] = {}  # id(node): (nodes once expanded, height)
    open_nodes: set[int] = set()

    def visit(node: Any, depth: int) -> tuple[int, int]:
        known = sizes.get(id(node))
        if known is None:
            if id(node) in open_nodes:
                raise yaml.MarkedYAMLError(
                    problem="an alias refers to a node that contains it", problem_mark=node.start_mark
                )
            if depth > MAX_NESTING:
                raise yaml.MarkedYAMLError(
                    problem=f"nested deeper than {MAX_NESTING} levels once aliases expand", problem_mark=node.start_mark
                )
            open_nodes.add(id(node))
            children = node.value if isinstance(node, yaml.SequenceNode) else []
            if isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            count, height = 1, 0
            for child in children:
                c, h = visit(child, depth + 1)
                count, height = count + c, max(height, h)
                if count > MAX_YAML_NODES:
                    raise yaml.MarkedYAMLError(
                        problem=f"aliases expand to more than {MAX_YAML_NODES} nodes", problem_mark=node.start_mark
                    )
            open_nodes.discard(id(node))
            known = sizes[id(node)] = (count, height + 1)
        if depth + known[1] - 1 > MAX_NESTING:
            raise yaml.MarkedYAMLError(
                problem=f"nested deeper than {MAX_NESTING} levels once aliases expand", problem_mark=node.start_mark
            )
        return known

    visit(root, 1)


def override_value(key: str, raw: str) -> Any:
    """The value of ``--set key=raw``: a number read strictly (finite, in range), else YAML, else text."""
    text = raw.strip()
    if _NUMBER.fullmatch(text):
        return _number(key, text)
    try:
        value = parse_yaml(text, f"override {key}")
    except ConfigError:
        return raw  # not YAML: a plain string such as a path
    if not _all_finite(value):
        raise ConfigError(f"override {key}={raw!r}: numbers must be finite, got a NaN or an infinity")
    return value


def _number(key: str, text: str) -> int | float:
    digits = text.replace("_", "")
    if digits.lower().lstrip("+-.") in ("nan", "inf", "infinity"):
        raise ConfigError(f"override {key}={text!r}: expected a finite number, e.g. 4 or 0.5")
    try:
        if re.fullmatch(r"[+-]?\d+", digits):
            return int(digits, 10)  # 010 is ten, not YAML 1.1's octal eight
        if re.fullmatch(r"[+-]?0[xob][0-9a-f]+", digits, re.I):
            return int(digits, 0)
        value = float(digits)
    except ValueError as err:  # 0x, 1e, 1.5e+, or more than 4,300 digits
        raise ConfigError(f"override {key}={text!r}: not a number ({err})") from err
    if not math.isfinite(value):
        raise ConfigError(f"override {key}={text!r}: the number overflows a float; expected a finite number")
    return value


def _all_finite(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return False
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True
