"""Every link in README.md and docs/*.md resolves: the file or folder exists, and a #anchor names a
heading of the file it points into (GitHub's anchors: benchmarks/make_report.py's `anchor`)."""

import re
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.make_report import anchor

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are not links)."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """A markdown file's heading anchors, with GitHub's -1, -2 ... for repeated headings."""
    seen: Counter = Counter()
    out = set()
    for line in re.sub(r"(?ms)^```.*?^```", "", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            a = anchor(m[1])
            out.add(f"{a}-{seen[a]}" if seen[a] else a)
            seen[a] += 1
    return out


def links(text: str) -> list[str]:
    """The relative links of markdown text (not URLs, not inside code)."""
    return [m[1] for m in LINK.finditer(_prose(text)) if not re.match(r"[a-z]+:", m[1])]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves(doc):
    broken = []
    for target in links(doc.read_text()):
        where, _, frag = target.partition("#")
        path = (doc.parent / where).resolve() if where else doc
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif frag and path.suffix == ".md" and frag not in anchors(path):
            broken.append(f"{target}: no heading #{frag} in {path.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_checker_sees_what_it_checks():
    api = ROOT / "docs" / "api.md"
    assert "generate-post-generate" in anchors(api)
    readme = links((ROOT / "README.md").read_text())
    assert "docs/api.md" in readme and any(t.startswith("docs/api.md#") for t in readme)
    assert links("[a](x.md#y) `[b](z)` [c](https://e.org)\n```\n[d](w)\n```") == ["x.md#y"]  # not code, not URLs
