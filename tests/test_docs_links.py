"""Every relative link of the README and docs/ points to a file of the repository (on a fresh clone too)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _relative_links(page: Path) -> list[str]:
    links = [m.group(1).split("#")[0] for m in LINK.finditer(page.read_text())]
    return [link for link in links if link and "://" not in link and not link.startswith("mailto:")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    missing = [link for link in _relative_links(page) if not (page.parent / link).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


def test_the_pages_have_links():
    assert sum(len(_relative_links(page)) for page in PAGES) > 20
