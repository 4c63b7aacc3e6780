"""Every ```python block in README.md and docs/ runs (each on its own, in a fresh namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks():
    for page in PAGES:
        for i, match in enumerate(FENCE.finditer(page.read_text())):
            yield pytest.param(match.group(1), id=f"{page.relative_to(ROOT)}#{i}")


@pytest.mark.parametrize("code", list(blocks()))
def test_docs_code_block_runs(code):
    exec(compile(code, "<docs>", "exec"), {"__name__": "docs_block"})
