"""The README and the pages in docs/ hold together: every relative link points to a file that
exists and, with an ``#anchor``, to a heading of that file; the README stays a front door."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")  # the target of [text](target) and ![alt](target)
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The text without code: a link-like string in a code block is code, not a link."""
    return _FENCE.sub("", text)


def links(page: Path) -> list[str]:
    return _LINK.findall(_CODE_SPAN.sub("", _prose(page.read_text())))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces
    as hyphens, a repeated heading numbered (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_prose(page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{target}: no file {dest.relative_to(root)}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return problems


def test_the_pages_are_found() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "architecture.md", "configuration.md", "benchmarks.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert links(page) or page.name != "README.md", "found no links in the README: scan broken"
    assert broken(page) == []


def test_the_check_sees_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Results, pushed\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#results-pushed) [file](missing.md) [anchor](a.md#nowhere) [self](#top)\n"
        "```\n[in code](missing-too.md)\n```\n"
    )
    assert broken(page, tmp_path.resolve()) == [
        "missing.md: no file missing.md",
        "a.md#nowhere: no heading #nowhere in a.md",
        "#top: no heading #top in b.md",
    ]


def test_the_readme_is_a_front_door() -> None:
    """Under 250 lines, and its first block holds the test command CI runs."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    first_block = readme.split("```", 2)[1]
    ci = (ROOT / ".ci" / "run").read_text()
    [ci_test] = [line for line in ci.splitlines() if line.startswith("python -m pytest")]
    assert ci_test in first_block
