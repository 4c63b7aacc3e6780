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


def test_the_configuration_reference_is_generated_from_the_structs():
    from flowrl._reference import config_reference

    page = Path(__file__).parent.parent / "docs" / "config.md"
    assert page.read_text() == config_reference(), "regenerate: python -m flowrl._reference > docs/config.md"


def test_every_config_key_has_a_description_and_no_description_is_stale():
    import msgspec

    from flowrl._reference import MEANING, section

    for cls, meanings in MEANING.items():
        assert [f.name for f in msgspec.structs.fields(cls)] == list(meanings), cls.__name__
        assert section(cls).count("\n| `") == len(meanings)
