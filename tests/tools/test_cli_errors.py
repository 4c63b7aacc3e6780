"""The flowrl command's mistakes: every FlowError is one line on stderr and exit 2, whatever the
command; a bug (any other exception) keeps its traceback. Run files that are unreadable, hostile
(alias bombs, deep nesting) or name arguments the class refuses; malformed --set numbers; corrupt
trace files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flowrl
from flowrl._core.observe.trace import Span, chrome_trace, read_trace_file
from flowrl._core.settings.config_files import MAX_CONFIG_BYTES, MAX_NESTING
from flowrl._tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "ppo_tiny.yaml")
FAST = ["--set", "run.pipeline.backend=inprocess", "--set", "models.ppo_policy.num_replicas=1"]


def alias_bomb(levels: int = 9) -> str:
    """The "billion laughs": each level a list of 9 aliases of the level below (9**levels leaves)."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def one_error_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"flowrl {command}: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize(
    "content, message",
    [
        (b"models: {}\ndataset: x\nname: caf\xe9\n", "run.yaml: not UTF-8 text (byte 31: invalid continuation byte)"),
        (alias_bomb().encode(), "run.yaml: not valid YAML: line 5, column 5: aliases expand to more than 50000 nodes"),
        (b"a: &x [*x]\n", "run.yaml: not valid YAML: line 1, column 4: an alias refers to a node that contains it"),
        (
            b"a: 2001-13-01\n",
            "run.yaml: not valid YAML: a value that does not fit its type (ValueError: month must be in 1..12)",
        ),
        (b"- models\n- dataset\n", "run.yaml: the top level must be a mapping with models, dataset and run, got list"),
        (b"a: !!python/object:os.system ls\n", "could not determine a constructor for the tag"),
        (b"x" * (MAX_CONFIG_BYTES + 1), f"run.yaml: larger than {MAX_CONFIG_BYTES} bytes"),
    ],
    ids=["encoding", "alias-bomb", "alias-cycle", "bad-date", "not-a-mapping", "python-tag", "huge"],
)
def test_a_bad_run_file_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    assert main(["run", str(path)]) == 2
    line = one_error_line(capsys, "run")
    assert line.startswith("flowrl run: ConfigError: ") and message in line, line


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 5000], ids=["just-past-the-bound", "past-libyamls-own-bound"])
def test_a_deep_run_file_is_refused_for_depth_in_flowrls_words(tmp_path, capsys, depth):
    # 5000 brackets: libyaml 0.2.6 (PyYAML 6.0.4) meets its own bound of 1000 before flowrl's composer
    # meets MAX_NESTING; the refusal must read the same whichever PyYAML and libyaml are installed
    path = tmp_path / "run.yaml"
    path.write_bytes(b"a: " + b"[" * depth)
    assert main(["run", str(path)]) == 2
    line = one_error_line(capsys, "run")
    expected = rf"flowrl run: ConfigError: {re.escape(str(path))}: not valid YAML: line 1, column \d+: "
    assert re.fullmatch(expected + f"nested deeper than {MAX_NESTING} levels", line), line


def test_a_folder_or_a_deep_toml_file_is_a_config_error(tmp_path, capsys):
    (tmp_path / "dir.yaml").mkdir()
    assert main(["run", str(tmp_path / "dir.yaml")]) == 2
    assert "dir.yaml: not a regular file" in one_error_line(capsys, "run")
    (tmp_path / "deep.toml").write_text("a = " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(flowrl.ConfigError, match=f"deep.toml: nested deeper than {MAX_NESTING} levels"):
        flowrl.RunConfig.load(tmp_path / "deep.toml")
    (tmp_path / "bad.toml").write_bytes(b"sample_per_episode = \xff\n")
    with pytest.raises(flowrl.ConfigError, match="bad.toml: not UTF-8 text"):
        flowrl.RunConfig.load(tmp_path / "bad.toml")


def test_run_config_load_refuses_the_alias_bomb_and_keeps_plain_aliases(tmp_path):
    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    with pytest.raises(flowrl.ConfigError, match="aliases expand to more than"):
        flowrl.RunConfig.load(tmp_path / "bomb.yaml")
    (tmp_path / "ok.yaml").write_text(
        "sample_per_episode: 4\nmodels:\n  a: &base {batch_size: 2, num_replicas: 1}\n  b: {<<: *base, batch_size: 4}\n"
        "  c: *base\n"
    )
    models = flowrl.RunConfig.load(tmp_path / "ok.yaml").models
    assert (models["b"].batch_size, models["c"].batch_size, models["b"].replicas) == (4, 2, 1)


@pytest.mark.parametrize(
    "override, message",
    [
        ("run.num_episode=1e999", "override run.num_episode='1e999': the number overflows a float"),
        ("run.seed=0x", "override run.seed='0x': not a number"),
        ("run.seed=1e", "override run.seed='1e': not a number"),
        ("run.collective_timeout_s=nan", "override run.collective_timeout_s='nan': expected a finite number"),
        ("run.collective_timeout_s=-.inf", "override run.collective_timeout_s='-.inf': expected a finite number"),
        ("run.colocation=[[1.0e+999]]", "override run.colocation='[[1.0e+999]]': numbers must be finite"),
        ("run.seed=" + "9" * 5000, "not a number (Exceeds the limit (4300 digits)"),
        ("run.seed=1.5", "run: Expected `int`, got `float` - at `$.seed`"),
    ],
)
def test_a_malformed_number_in_set_names_the_key(capsys, override, message):
    assert main(["run", EXAMPLE, "--set", override, *FAST]) == 2
    line = one_error_line(capsys, "run")
    assert line.startswith("flowrl run: ConfigError: ") and message in line, line


def test_set_reads_numbers_strictly_and_keeps_text_that_is_no_number(tmp_path):
    (tmp_path / "run.yaml").write_text("sample_per_episode: 4\n")
    cfg = flowrl.RunConfig.load(
        tmp_path / "run.yaml", ["seed=010", "num_episode=0x2", "run_dir=7b-runs/1.2.3", "collective_timeout_s=1e3"]
    )
    assert (cfg.seed, cfg.num_episode, cfg.run_dir, cfg.collective_timeout_s) == (10, 2, "7b-runs/1.2.3", 1000.0)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of models and datasets in the current folder, as `flowrl run` users write them."""
    (tmp_path / "cli_err_user.py").write_text(
        "import flowrl\n"
        "class Sized(flowrl.Model):\n"
        "    def __init__(self, name, config=None, *, width, depth=2):\n"
        "        super().__init__(name, config)\n"
        "        if width < 1:\n            raise ValueError(f'width must be >= 1, got {width}')\n"
        "    def forward_step(self, batch, iteration):\n        return {'y': batch['x']}\n"
        "class Trainer(flowrl.Model):\n"
        "    def train_step(self, batch, iteration):\n        return {}\n"
        "def rollout(prompts, *, gen):\n    return gen.forward_step(prompts)\n"
        "def broken():\n    raise KeyError('shard-7')\n"
        "NUMBER = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(
        "flow: cli_err_user:rollout\ndataset: cli_err_user:NUMBER\ntrain: [trainer]\n"
        "models:\n  gen: {class: cli_err_user:Sized, args: {width: 4}}\n  trainer: {class: cli_err_user:Trainer}\n"
        "run: {sample_per_episode: 4, pipeline: {backend: inprocess}}\n"
    )
    return "run.yaml"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["models.gen.args.widht=4"],
            "models.gen.args: Sized refuses {'width': 4, 'widht': 4} (got an unexpected keyword argument 'widht'); "
            "its arguments besides the name and config flowrl passes: width, depth=2",
        ),
        (["models.gen.args={depth: 3}"], "models.gen.args: Sized refuses {'depth': 3} (missing a required argument"),
        (
            ["models.gen.args.width=0"],
            "models.gen: Sized(...) failed: ValueError: width must be >= 1, got 0",
        ),
        (["models.gen.args={1: 2}"], "models.gen.args: expected a mapping of keyword arguments, got {1: 2}"),
        (["models.gen.class=7"], "models.gen.class: expected module:name, e.g. ppo_tiny:Policy, got 7"),
        ([], "dataset: cli_err_user:NUMBER is a int; expected a sequence of mappings"),
        (["dataset=cli_err_user:broken"], "dataset: building cli_err_user:broken failed: KeyError: 'shard-7'"),
        (["dataset=cli_err_user:rollout", "relay=cli_err_user:NUMBER"], "dataset: building cli_err_user:rollout"),
        (["flow=cli_err_user:NUMBER"], "flow: cli_err_user:NUMBER is a int; expected a function"),
        (["flow=..cli_err_user:rollout"], "flow: importing module '..cli_err_user' failed: TypeError"),
        (
            ["flow=os.path:join"],  # called as flow(prompts, gen=...): it takes no such keyword
            "flow: os.path:join is called as flow(prompts, gen=...) with the models that are not trainers, and "
            "cannot take that call (got an unexpected keyword argument 'gen')",
        ),
    ],
)
def test_constructor_arguments_and_resolved_objects_are_named(user_module, capsys, overrides, message):
    argv = ["run", user_module]
    for item in overrides:
        argv += ["--set", item]
    assert main(argv) == 2
    line = one_error_line(capsys, "run")
    assert line.startswith("flowrl run: ConfigError: ") and message in line, line


def test_the_init_failure_is_chained(user_module):
    from flowrl._tools.run_file import build_engine, load_run_file

    with pytest.raises(flowrl.ConfigError, match=r"models.gen: Sized\(...\) failed") as info:
        build_engine(load_run_file(user_module, ["models.gen.args.width=0"]))
    assert isinstance(info.value.__cause__, ValueError)


def test_relay_of_the_wrong_kind_is_refused(user_module, tmp_path):
    from flowrl._tools.run_file import build_engine, load_run_file

    (tmp_path / "cli_err_items.py").write_text("def items():\n    return [{'x': 1.0}] * 4\nRELAY = 'last'\n")
    spec = load_run_file(user_module, ["dataset=cli_err_items:items", "relay=cli_err_items:RELAY"])
    with pytest.raises(flowrl.ConfigError, match="relay: cli_err_items:RELAY is a str; expected a function"):
        build_engine(spec)


def write_trace(tmp_path: Path) -> Path:
    spans = [Span(group="policy", lane=0, name="policy.forward_step", start=1.0, end=1.5, args={"samples": 2})]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(chrome_trace(spans)))
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t[:40], "is not a flowrl trace: not JSON: Input data was truncated"),
        (lambda t: t.replace('"dur": 500000.0', '"dur": -1'), "Expected `float` >= 0.0 - at `$.traceEvents[3].dur`"),
        (lambda t: t.replace('"dur": 500000.0', '"dur": 1e999'), "Number out of range - at `$.traceEvents[3].dur`"),
        (
            lambda t: t.replace('"ts": 0.0', '"ts": "0"'),
            "Expected `float | null`, got `str` - at `$.traceEvents[3].ts`",
        ),
        (lambda t: t.replace('"samples": 2', '"samples": "two"'), "traceEvents[3].args.samples: expected a count"),
        (lambda t: t.replace('"pid": 1, "tid": 0, "ts"', '"pid": 9, "tid": 0, "ts"'), "traceEvents[3].pid: 9 is named"),
        (lambda t: t.replace(', "dur": 500000.0', ""), "traceEvents[3]: a complete event (ph X) needs ts and dur"),
        (lambda t: "[" * 100_000, "is not a flowrl trace"),
        (lambda t: t.replace('"tid": 0, "ts"', '"tid": 123456789012345678901234567890, "ts"'), "traceEvents[3].tid"),
    ],
    ids=["truncated", "negative-dur", "huge-dur", "ts-str", "samples-str", "unnamed-pid", "no-dur", "deep", "big-int"],
)
def test_a_corrupt_trace_is_one_line_and_exit_2(tmp_path, capsys, edit, message):
    path = write_trace(tmp_path)
    assert main(["trace", str(path), "--no-png"]) == 0  # the intact file reads
    capsys.readouterr()
    path.write_text(edit(path.read_text()))
    assert main(["trace", str(path), "--no-png"]) == 2
    line = one_error_line(capsys, "trace")
    assert line.startswith(f"flowrl trace: ConfigError: {path}") and message in line, line


def test_a_trace_over_the_size_bound_is_refused_before_it_is_read(tmp_path):
    path = write_trace(tmp_path)
    with pytest.raises(flowrl.ConfigError, match=r"trace.json: \d+ bytes, larger than 100; not a flowrl trace"):
        read_trace_file(path, max_bytes=100)


def test_an_unexpected_exception_keeps_its_traceback(monkeypatch, capsys):
    import flowrl._tools.run_file as run_file

    def bug(*args, **kwargs):
        raise RuntimeError("a bug in flowrl")

    monkeypatch.setattr(run_file, "load_run_file", bug)
    with pytest.raises(RuntimeError, match="a bug in flowrl"):
        main(["run", EXAMPLE])
    assert capsys.readouterr().err == ""  # not turned into a line: Python prints its traceback


def test_the_flowrl_command_exits_2_with_one_line(tmp_path):
    (tmp_path / "bomb.yaml").write_text(alias_bomb())
    done = subprocess.run(
        [sys.executable, "-m", "flowrl", "run", str(tmp_path / "bomb.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"flowrl run: ConfigError: {tmp_path / 'bomb.yaml'}: not valid YAML: line 5, column 5: aliases expand to "
        "more than 50000 nodes"
    ]


def test_a_toml_integer_past_pythons_digit_limit_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("x = " + "1" * 5001 + "\n")
    assert main(["run", str(path)]) == 2
    line = one_error_line(capsys, "run")
    assert line.startswith(f"flowrl run: ConfigError: {path}: not valid TOML: ") and "digits" in line, line
