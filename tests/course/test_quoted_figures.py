"""The course quotes measured figures only from committed outputs, and the two cannot drift apart.

A table or paragraph in course/*.md that quotes measured figures carries a marker on the line above it:

    <!-- source: lessons/05_practice.ipynb -->
    <!-- source: course/measured/bench-schedules-amd-epyc-zen5.txt, lessons/04_tuning.ipynb (section 6) -->

Every decimal number in that block (the lines up to the next blank line) must appear in one of the sources: in a
notebook's stored outputs, or in a results file, as printed or rounded to the digits the text gives; so must every whole number of
milliseconds ("423 ms"). Other integers, versions (2.13.0) and section numbers (5.1.6) are not checked. A number the text works out itself (a ratio of two
quoted figures, a formula's value) is listed after the sources, and must then appear in the block:

    <!-- source: lessons/02_principles.ipynb; derived: 1.38 -->

A notebook re-executed with other timings, or a results file measured again, fails here until the text quotes the
new figures.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^\s*<!--\s*source:\s*(.+?)\s*-->\s*$")
# A decimal not part of a version or section number (1.2.3), a word (v1.2) or a heading mark (§5.1).
DECIMAL = re.compile(r"(?<![\w.§])(\d+\.\d+)(?![\d.]*\.\d)(?!\d)")


def _blocks(chapter: Path) -> list[tuple[int, list[str], list[str], str]]:
    """(line number of the marker, its sources, its derived numbers, the block's text) for each marker."""
    lines = chapter.read_text(encoding="utf-8").splitlines()
    found = []
    for number, line in enumerate(lines):
        marker = MARKER.match(line)
        if marker is None:
            continue
        block = []
        for following in lines[number + 1 :]:
            if not following.strip():
                break
            block.append(following)
        # A note in parentheses after a source (which section of the notebook) is for the reader.
        sources, _, derived = re.sub(r"\([^)]*\)", "", marker.group(1)).partition(";")
        derived = derived.strip().removeprefix("derived:").split(",")
        named = [s.strip() for s in sources.split(",")]
        found.append((number + 1, named, [d.strip() for d in derived if d.strip()], "\n".join(block)))
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
    for chapter in sorted((REPO / "course").glob("*.md"))
    for line, sources, derived, block in _blocks(chapter)
]


def test_the_course_marks_its_measured_figures():
    assert len(MARKED) >= 5, "the chapters should mark where their measured figures come from"


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
        assert path.is_file(), f"{chapter.name}:{line} names {source}, which is not in the repository"
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
