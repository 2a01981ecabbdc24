"""What a learner expects of every chapter: objectives, prerequisites, a time estimate, answers, one glossary.

The checks read the Markdown as a learner meets it: each numbered chapter has an English abstract, a block of
学习目标 / 先修 / 预计用时 near its top, and every question of its 自测题 is followed by an answer or a hint
(`<details>`); the glossary exists and defines the terms the course asks to keep one name for; every figure a
chapter shows is in the repository, every chapter shows at least one, and each is drawn by tools/figures/.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COURSE = REPO / "course"
# A chapter's appendix (04-tuning-appendix.md) holds its measurement detours; it is not a chapter of its own.
CHAPTERS = sorted(p for p in COURSE.glob("0*.md") if not p.name.endswith("-appendix.md"))


def _section(text: str, title: str) -> str:
    """The body of the first heading containing `title`, up to the next heading of the same or a higher level."""
    match = re.search(rf"^(#+) [^\n]*{title}[^\n]*$", text, re.M)
    if match is None:
        return ""
    level = len(match.group(1))
    rest = text[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def test_there_are_the_chapters_of_the_course():
    names = [c.name for c in CHAPTERS]
    assert len(names) >= 6 and names[0].startswith("00-"), names


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.name)
def test_each_chapter_opens_with_an_abstract_objectives_prerequisites_and_a_time(chapter):
    text = chapter.read_text(encoding="utf-8")
    head = text[: len(text) // 4 + 4000]  # near the top, not somewhere in the middle
    assert "> **Abstract.**" in head, f"{chapter.name}: no English abstract at the top"
    for what in ("学习目标", "先修", "预计用时"):
        assert what in head, f"{chapter.name}: no {what} near the top"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.name)
def test_every_self_test_question_has_an_answer_or_a_hint(chapter):
    quiz = _section(chapter.read_text(encoding="utf-8"), "自测题")
    assert quiz, f"{chapter.name}: no 自测题 section"
    numbered = r"^\s*(?:\d+\. |\*\*\d+\.\*\*)"  # "1. " or "**1.**"
    blocks = re.findall(r"<details[^>]*>\s*<summary>\s*(?:答案|提示).*?</details>", quiz, re.S)
    # One block after each question, or one block that answers them all in a numbered list.
    answers = sum(max(1, len(re.findall(numbered, block, re.M))) for block in blocks)
    for block in blocks:
        quiz = quiz.replace(block, "")
    questions = re.findall(numbered, quiz, re.M)
    assert questions, f"{chapter.name}: its 自测题 has no numbered questions"
    assert answers >= len(questions), (
        f"{chapter.name}: {len(questions)} questions but {answers} answers or hints "
        "(<details><summary>答案</summary>...</details> after each)"
    )


def test_the_glossary_names_each_idea_once():
    glossary = (COURSE / "glossary.md").read_text(encoding="utf-8")
    for term in ("分片", "暂存", "上行", "下行", "延迟参数更新", "锁页内存", "模拟设备"):
        assert term in glossary, f"the glossary does not define {term}"
    assert glossary.count("\n") >= 40


def test_the_course_shows_its_figures_and_each_is_in_the_repository():
    shown = set()
    for chapter in COURSE.glob("*.md"):
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", chapter.read_text(encoding="utf-8")):
            assert (chapter.parent / target).is_file(), f"{chapter.name} shows {target}, which is missing"
            shown.add(target)
    assert len(shown) >= 3, f"the course shows {len(shown)} figures: {sorted(shown)}"


FIGURE = re.compile(r"!\[[^\]]*\]\((figures/[^)\s]+\.png)\)")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: c.name)
def test_each_chapter_shows_a_figure_that_the_figure_modules_draw(chapter):
    """A picture where a picture says it better: every chapter has one, and none is drawn by hand (each is one
    that `python -m tools.draw_figures` writes, so tests/course/test_figures.py checks its bytes)."""
    from tools.figures import collect

    drawn = set(collect())
    shown = FIGURE.findall(chapter.read_text(encoding="utf-8"))
    assert shown, f"{chapter.name} shows no figure (![English alt text](figures/NAME.png))"
    for target in shown:
        name = target.removeprefix("figures/")
        assert name in drawn, f"{chapter.name} shows {target}, which no module of tools/figures/ draws"
