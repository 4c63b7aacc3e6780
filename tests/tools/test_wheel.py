"""Packaging: every package of the source tree goes into the wheel (fast, from pyproject.toml), and
scripts/check_wheel.sh (which .ci/run calls) builds the wheel, installs it into a fresh venv and
runs it from outside the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_source_tree_is_packaged():
    from setuptools import find_packages

    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(where=str(ROOT), include=setuptools_cfg["packages"]["find"]["include"]))
    folders = {p.parent for p in (ROOT / "flowrl").rglob("*.py") if "__pycache__" not in p.parts}
    wanted = {".".join(f.relative_to(ROOT).parts) for f in folders}
    assert wanted == found, f"missing {sorted(wanted - found)}, extra {sorted(found - wanted)}"
    assert {"flowrl.hf", "flowrl.rl", "flowrl._core", "flowrl._sim", "flowrl._tools"} <= found
    assert setuptools_cfg["package-data"]["flowrl"] == ["py.typed"] and (ROOT / "flowrl" / "py.typed").is_file()


@pytest.mark.slow  # a build, a venv and two short runs: 2-3 minutes on 2 busy cores
def test_the_built_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_wheel.sh")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)},
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert f"/venv/lib/python3.{sys.version_info.minor}/site-packages/flowrl" in out  # imported from the venv
    assert "mean reward: first" in out and "check_wheel: the wheel installs and runs" in out
