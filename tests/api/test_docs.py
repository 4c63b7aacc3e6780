"""Every ```python block in README.md and docs/ runs (each on its own, in a fresh namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks():
    for page in PAGES:
        for i, match in enumerate(FENCE.finditer(page.read_text())):
            yield pytest.param(match.group(1), id=f"{page.relative_to(ROOT)}#{i}")


@pytest.mark.parametrize("code", list(blocks()))
def test_docs_code_block_runs(code):
    exec(compile(code, "<docs>", "exec"), {"__name__": "docs_block"})


def test_the_configuration_reference_is_generated_from_the_structs():
    from flowrl._tools.reference import config_reference

    page = ROOT / "docs" / "config.md"
    assert page.read_text() == config_reference(), "regenerate: python -m flowrl._tools.reference > docs/config.md"


def test_every_config_key_has_a_description_and_no_description_is_stale():
    import msgspec

    from flowrl._tools.reference import MEANING, section

    for cls, meanings in MEANING.items():
        assert [f.name for f in msgspec.structs.fields(cls)] == list(meanings), cls.__name__
        assert section(cls).count("\n| `") == len(meanings)


BASH = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def flowrl_commands(page: Path) -> list[list[str]]:
    """The ``flowrl ...`` lines of a page's bash blocks, in order, without trailing comments."""
    import shlex

    return [
        shlex.split(line, comments=True)
        for block in BASH.findall(page.read_text())
        for line in block.splitlines()
        if line.startswith("flowrl ")
    ]


@pytest.mark.parametrize("page", [p for p in PAGES if flowrl_commands(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_flowrl_commands_run(page, tmp_path):
    """Each page's commands run in order in a fresh folder: in one process (FLOWRL_DEBUG=1) and
    for 2 episodes, to keep the test short; the rest of each command as written. A `flowrl scale`
    comes after its run has ended, so it must refuse (exit 2: no live run); the live case is
    tests/engine/test_scale_requests.py's."""
    import os
    import shutil
    import subprocess
    import sys

    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # the commands run from a checkout's root
    env = {**os.environ, "FLOWRL_DEBUG": "1", "PYTHONPATH": str(ROOT)}
    for command in flowrl_commands(page):
        args = command[1:]
        if args[0] == "run":
            args += ["--set", "run.num_episode=2", "--set", "run.progress=off"]
        proc = subprocess.run(
            [sys.executable, "-m", "flowrl", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        if args[0] == "scale":  # written for another terminal while the run runs; here the run has ended
            assert proc.returncode == 2 and "no live run" in proc.stderr, (command, proc.stderr[-3000:])
            continue
        assert proc.returncode == 0, (command, proc.stdout[-2000:], proc.stderr[-3000:])


YAML = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize(
    "page", [p for p in PAGES if YAML.search(p.read_text())], ids=lambda p: str(p.relative_to(ROOT))
)
def test_docs_run_files_are_valid(page, tmp_path):
    """Every YAML block is a valid RunConfig file, or a valid run file (with a dataset): its keys,
    RunConfig and each ModelConfig check out (the model classes of an illustrative package are
    not imported; examples' are)."""
    import yaml

    from flowrl import ModelConfig, RunConfig
    from flowrl._core.settings.config import to_config
    from flowrl._tools.run_file import load_run_file, resolve

    for i, block in enumerate(YAML.findall(page.read_text())):
        path = tmp_path / f"block{i}.yaml"
        path.write_text(block)
        if "dataset" not in yaml.safe_load(block):
            RunConfig.load(path)
            continue
        spec = load_run_file(path)
        to_config(RunConfig, spec.run, "run")
        for name, entry in spec.models.items():
            to_config(ModelConfig, {k: v for k, v in entry.items() if k not in ("class", "args")}, name)
            if entry["class"].startswith("examples."):
                resolve(entry["class"], f"models.{name}.class")
