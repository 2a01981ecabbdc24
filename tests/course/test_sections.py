"""Sections a learner finishes in one sitting: at most 25 minutes of reading at 300 characters a minute, each
opening with its takeaway and closing with a quiz the site can check (tools/site/sections.py has the rules)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.site.sections import (
    CHARS_PER_MINUTE,
    MAX_MINUTES,
    QUIZ_HEADING,
    Section,
    questions,
    quiz_block,
    reading_minutes,
    sections,
    takeaway,
)

COURSE = Path(__file__).resolve().parents[2] / "course"
# Every chapter and every appendix is written in sections of one sitting.
SECTIONED = sorted(COURSE.glob("0*.md"))


def problems(text: str) -> list[str]:
    """What keeps a chapter's sections from being read one sitting at a time."""
    found = []
    for section in sections(text):
        where = f"## {section.title} (line {section.line})"
        minutes = reading_minutes(section.body)
        if minutes > MAX_MINUTES:
            found.append(
                f"{where}: {minutes:.0f} min of reading at {CHARS_PER_MINUTE} characters a minute "
                f"(at most {MAX_MINUTES}): split it, or move a measurement detour to the appendix"
            )
        if section.is_frame:
            continue
        if takeaway(section) is None:
            found.append(f"{where}: does not open with its takeaway (> **要点**：…)")
        quiz = quiz_block(section)
        if quiz is None:
            found.append(f"{where}: does not end with {QUIZ_HEADING}")
            continue
        try:
            asked = questions(quiz)
        except ValueError as error:
            found.append(f"{where}: {error}")
            continue
        if not 2 <= len(asked) <= 3:
            found.append(f"{where}: its quiz has {len(asked)} questions (2 or 3)")
        if not any(q.kind != "open" for q in asked):
            found.append(f"{where}: no question the page can check (<!-- quiz: choice X --> or number V ±T)")
        for q in asked:
            if not q.answered:
                found.append(f"{where}: question {q.number} has no <details><summary>答案 (or 提示)")
    return found


def test_the_check_covers_the_whole_course():
    names = {p.name for p in SECTIONED}
    assert {"00-overview.md", "04-tuning.md", "04-tuning-appendix.md", "06-state-of-the-art.md"} <= names, (
        names
    )


@pytest.mark.parametrize("chapter", SECTIONED, ids=lambda p: p.name)
def test_each_section_is_one_sitting_with_a_takeaway_and_a_quiz(chapter):
    found = problems(chapter.read_text(encoding="utf-8"))
    assert not found, f"{chapter.name}:\n  " + "\n  ".join(found)


GOOD = """\
## 1.1 A section

> **要点**：one idea.

Some text.

```python
## not a heading, inside code
```

### 小测

1. Which one? <!-- quiz: choice B -->

    - A. this
    - B. that

<details><summary>答案</summary>

B. Because.

1. a numbered line inside the answer is not a question

</details>

2. How many? <!-- quiz: number 208 ±1% -->

<details><summary>答案</summary>

208.

</details>

3. Why?

<details><summary>提示</summary>

Think.

</details>

## 1.9 小结

Summary without a quiz.
"""


def test_a_good_section_passes_and_its_questions_parse():
    assert problems(GOOD) == []
    first = sections(GOOD)[0]
    asked = questions(quiz_block(first))
    assert [(q.number, q.kind, q.answer) for q in asked] == [
        (1, "choice", "B"),
        (2, "number", "208"),
        (3, "open", None),
    ]
    assert asked[0].options == (("A", "this"), ("B", "that"))
    assert asked[0].accepts("b") and not asked[0].accepts("A")
    assert asked[1].accepts("210") and asked[1].accepts("206") and not asked[1].accepts("211")
    assert not asked[1].accepts("lots")


@pytest.mark.parametrize(
    ("edit", "complaint"),
    [
        (lambda t: t.replace("> **要点**：one idea.\n", ""), "takeaway"),
        (lambda t: t.replace("### 小测", "### Questions"), "does not end with"),
        (
            lambda t: t.replace("<!-- quiz: choice B -->", "").replace("<!-- quiz: number 208 ±1% -->", ""),
            "can check",
        ),
        (lambda t: t.replace("choice B", "choice C"), "not one of its options"),
        (lambda t: t.replace("number 208 ±1%", "number 208"), "cannot read"),
        (
            lambda t: t.replace("<details><summary>提示</summary>\n\nThink.\n\n</details>\n", ""),
            "question 3 has no",
        ),
        (lambda t: t.replace("Some text.", "长" * (CHARS_PER_MINUTE * MAX_MINUTES + 1)), "min of reading"),
        (
            lambda t: t.replace(
                "2. How many?", "4. How many?\n\n<details><summary>答案</summary>x</details>\n\n2. How?"
            ),
            "4 questions",
        ),
    ],
)
def test_the_check_sees_each_kind_of_problem(edit, complaint):
    found = problems(edit(GOOD))
    assert any(complaint in f for f in found), found


def test_answers_and_sources_do_not_count_as_reading():
    body = (
        "字" * 300
        + "\n<details><summary>答案</summary>\n"
        + "答" * 3000
        + "\n</details>\n<sub>来源：[x](x)</sub>\n"
    )
    assert reading_minutes(body) == pytest.approx(1.0)
    assert Section("x", 1, body).is_frame is False
