"""The course quotes measured figures only from committed outputs, shows the reader where each comes from, and
the two cannot drift apart.

A table or paragraph in course/*.md that quotes measured figures is followed, after a blank line, by a line the
reader sees (on GitHub and on the site) that links to its sources:

    | schedule | ms |
    |---|---|
    | serial | 39.6 |

    <sub>来源：[lessons/05_practice.ipynb](../lessons/05_practice.ipynb)（第 6 节）</sub>

Every decimal number in that block (the lines above the source line, up to the blank line before them) must appear
in one of the sources that are repository files: in a notebook's stored outputs, or in a results file, as printed or
rounded to the digits the text gives; so must every whole number of milliseconds ("423 ms"). Other integers,
versions (2.13.0) and section numbers (5.1.6, "4.11 节") are not checked. A note in full-width parentheses says where in the
source to look. A number the text works out itself (a ratio of two quoted figures, a formula's value) is listed
after the sources, and must then appear in the block:

    <sub>来源：[lessons/02_principles.ipynb](../lessons/02_principles.ipynb)；推导：1.38</sub>

A link to a paper or to DeepSpeed's source is shown like the others but its numbers cannot be checked here. A
notebook re-executed with other timings, or a results file measured again, fails here until the text quotes the
new figures.
"""

from __future__ import annotations

import json
import posixpath
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COURSE = REPO / "course"
MARKER = re.compile(r"^\s*<sub>来源：(.+?)</sub>\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A decimal not part of a version or section number (1.2.3), a word (v1.2), a heading mark (§5.1) or a
# reference to a section ("4.11 节", "4.10、4.11 节").
DECIMAL = re.compile(r"(?<![\w.§])(\d+\.\d+)(?![\d.]*\.\d)(?!\d)(?!(?:\s?[、和]\s?\d+\.\d+)*\s?节)")


def chapters() -> list[Path]:
    return sorted(COURSE.rglob("*.md"))


def _blocks(chapter: Path) -> list[tuple[int, list[str], list[str], str]]:
    """(line number of the source line, the repository files it links, its derived numbers, the block's text)."""
    lines = chapter.read_text(encoding="utf-8").splitlines()
    found = []
    for number, line in enumerate(lines):
        marker = MARKER.match(line)
        if marker is None:
            continue
        above = number - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        block: list[str] = []
        while above >= 0 and lines[above].strip() and not MARKER.match(lines[above]):
            block.insert(0, lines[above])
            above -= 1
        sources, _, derived = marker.group(1).partition("；推导：")
        files = []
        for target in LINK.findall(sources):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # a paper or DeepSpeed's source: shown, not checked
                continue
            path = posixpath.normpath(posixpath.join(chapter.parent.relative_to(REPO).as_posix(), target))
            files.append(path.partition("#")[0])
        numbers = [d.strip() for d in re.split(r"[、,]", derived) if d.strip()]
        found.append((number + 1, files, numbers, "\n".join(block)))
    return found


def _source_text(path: Path) -> str:
    """The text whose numbers count: a notebook's stored outputs, or a results file as it is."""
    if path.suffix != ".ipynb":
        return path.read_text(encoding="utf-8")
    parts = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            parts.append("".join(text) if isinstance(text, list) else text)
    return "\n".join(parts)


# A whole number of milliseconds (423 ms): a timing, though it has no decimals; and any whole number printed.
WHOLE = re.compile(r"(?<![\w.,])(\d+)(?![\d.,])")
MILLISECONDS = re.compile(r"(?<![\w.,])(\d+)(?=\s?ms\b)")


def _numbers(text: str) -> list[str]:
    text = re.sub(r"(?<=[x×])(?=\d)", " ", text)  # "x1.32" is a ratio as printed
    return DECIMAL.findall(text) + MILLISECONDS.findall(text)


def _appears(quoted: str, printed: list[str]) -> bool:
    """Whether `quoted` is one of the printed numbers, or one of them rounded to `quoted`'s digits."""
    digits = len(quoted.partition(".")[2])
    target = float(quoted)
    for value in printed:
        if len(value.partition(".")[2]) >= digits and abs(float(value) - target) <= 0.5 * 10**-digits + 1e-12:
            return True
    return False


MARKED = [
    pytest.param(chapter, line, sources, derived, block, id=f"{chapter.name}:{line}")
    for chapter in chapters()
    for line, sources, derived, block in _blocks(chapter)
]


def test_the_course_marks_its_measured_figures():
    assert len(MARKED) >= 5, "the chapters should mark where their measured figures come from"


@pytest.mark.parametrize("chapter", chapters(), ids=lambda c: c.relative_to(COURSE).as_posix())
def test_every_source_is_visible(chapter):
    """A source in an HTML comment is seen by no reader: it goes on a <sub>来源：…</sub> line below the block."""
    text = chapter.read_text(encoding="utf-8")
    assert "<!-- source" not in text, (
        f"{chapter.name}: a hidden source comment; show it as <sub>来源：…</sub>"
    )
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("<sub>来源"):
            assert MARKER.match(line), f"{chapter.name}:{number}: a source line this test cannot read: {line}"
            assert LINK.search(line), f"{chapter.name}:{number}: a source line with no link"


@pytest.mark.parametrize(("chapter", "line", "sources", "derived", "block"), MARKED)
def test_each_quoted_figure_appears_in_its_source(chapter, line, sources, derived, block):
    quoted = _numbers(block)
    stale = [d for d in derived if d not in quoted]
    assert not stale, (
        f"{chapter.name}:{line}: the marker lists {stale} as derived, but the block does not say them"
    )
    printed: list[str] = []
    for source in sources:
        path = REPO / source
        assert path.is_file(), f"{chapter.name}:{line} links {source}, which is not in the repository"
        text = _source_text(path)
        printed += _numbers(text) + WHOLE.findall(text)  # a quoted "423 ms" may be printed as "423"
    missing = [q for q in quoted if q not in derived and not _appears(q, printed)]
    assert not missing, (
        f"{chapter.name}:{line}: {missing} do not appear in {', '.join(sources)}; quote what the source shows "
        "(or re-run what produced it and commit the new output)"
    )


def test_the_checker_tells_a_stale_figure_from_a_rounded_one():
    printed = _numbers("median 46.2026 ms, DPU/serial 1.30x, torch 2.13.0, section 5.1.6, recompute x1.32")
    assert _appears("46.2", printed) and _appears("46.20", printed) and _appears("1.30", printed)
    assert _appears("1.32", printed)
    assert not _appears("46.3", printed) and not _appears("1.3000", printed)
    assert _numbers("v0.19.6 and §5.1.6 and 5.1.6 节, but 1.56× and 0.98") == ["1.56", "0.98"]
    assert _numbers("a step of 423 ms, 4 steps") == ["423"] and _appears("423", ["422.6"])
    assert not _appears("423", ["425"])
