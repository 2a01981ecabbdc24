"""The sections' quizzes as questions a learner answers in the page (staging time, on the chapters' copies).

A question marked ``<!-- quiz: choice X -->`` or ``<!-- quiz: number V ±T -->`` (``sections.py`` has the
format) is wrapped, with the ``<details>`` answer that follows it, in a block the site's script
(``tools/site/assets/quiz.js``) makes interactive::

    <div class="zo-quiz" data-quiz="choice" data-answer="B" markdown="1">

    1. Which one?

        <label class="zo-quiz-option"><input type="radio" name="zo-quiz-1" value="A"> A. this</label>
        ...

        <button type="button" class="zo-quiz-check">检查</button> <span class="zo-quiz-result" …></span>

    <details markdown="1"><summary>答案</summary> …

    </div>

The question keeps its number (``sane_lists`` starts the list at it) and its text, the options become a radio
group (their text still Markdown: code, math), a number question gets a text box. The answer is in the data
attributes (it is a self-test), and the script checks a number with ``Question.accepts``' rule: within
``data-tolerance``, a fraction of the answer where ``data-relative`` is ``1``. Open questions stay as written.
The sources are not touched: on GitHub the marks are HTML comments and the questions read as plain Markdown.
"""

from __future__ import annotations

import html
import re

from .sections import OPTION, QUESTION, QUIZ_MARK, Question, questions, quiz_block, sections

DETAILS_OPEN = re.compile(r"^\s*<details\b")
DETAILS_CLOSE = re.compile(r"</details>\s*$")
CHECK = "检查"


def _attrs(q: Question) -> str:
    pairs = [("class", "zo-quiz"), ("data-quiz", q.kind), ("data-answer", q.answer or "")]
    if q.kind == "number":
        pairs += [("data-tolerance", repr(q.tolerance)), ("data-relative", "1" if q.relative else "0")]
    return " ".join(f'{k}="{html.escape(v)}"' for k, v in pairs)


def _controls(q: Question, name: str, indent: str) -> list[str]:
    """The lines that replace a choice question's options, or follow a number question's text."""
    lines = []
    if q.kind == "choice":
        for letter, text in q.options:
            lines.append(
                f'{indent}<label class="zo-quiz-option"><input type="radio" name="{name}" value="{letter}"> '
                f"{letter}. {text}</label>"
            )
        lines.append("")
        button = ""
    else:
        button = (
            f'<input type="text" class="zo-quiz-number" name="{name}" inputmode="decimal" autocomplete="off" '
            'aria-label="你的答案"> '
        )
    lines.append(
        f'{indent}{button}<button type="button" class="zo-quiz-check">{CHECK}</button> '
        '<span class="zo-quiz-result" role="status" aria-live="polite"></span>'
    )
    return lines


def _quiz_lines(lines: list[str], asked: list[Question], counter: list[int]) -> list[str]:
    """One quiz block's lines with each checkable question (and its answer) wrapped for the page."""
    # Where each question starts, outside the answers (as sections.questions() reads them).
    starts, inside = [], False
    for i, line in enumerate(lines):
        if not inside and DETAILS_OPEN.match(line):
            inside = not DETAILS_CLOSE.search(line)
        elif inside:
            inside = not DETAILS_CLOSE.search(line)
        elif QUESTION.match(line):
            starts.append(i)
    if len(starts) != len(asked):  # cannot happen while both read the same lines; leave the block as written
        return lines
    out = lines[: starts[0]] if starts else lines
    for n, (start, q) in enumerate(zip(starts, asked, strict=True)):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        block = lines[start:end]
        if q.kind == "open":
            out += block
            continue
        # The question's own lines run up to its answer; the answer up to its </details>.
        answer = next((i for i, line in enumerate(block) if DETAILS_OPEN.match(line)), len(block))
        close = answer
        if answer < len(block):
            close = next(
                (i for i in range(answer, len(block)) if DETAILS_CLOSE.search(block[i])), len(block) - 1
            )
        asked_lines, answer_lines, rest = block[:answer], block[answer : close + 1], block[close + 1 :]
        counter[0] += 1
        name = f"zo-quiz-{counter[0]}"
        asked_lines[0] = QUIZ_MARK.sub("", asked_lines[0]).rstrip()
        while len(asked_lines) > 1 and not asked_lines[-1].strip():
            asked_lines.pop()
        options = [i for i, line in enumerate(asked_lines) if OPTION.match(line)]
        if q.kind == "choice" and options:
            indent = re.match(r"\s*", asked_lines[options[0]]).group(0)
            body = asked_lines[: options[0]] + _controls(q, name, indent) + asked_lines[options[-1] + 1 :]
        else:
            body = asked_lines + ["", *_controls(q, name, "    ")]
        out += [f'<div {_attrs(q)} markdown="1">', "", *body, ""]
        out += [*answer_lines, "", "</div>", ""] if answer_lines else ["</div>", ""]
        out += rest
    return out


def quiz_markdown(text: str) -> str:
    """A chapter's Markdown with every checkable quiz question made into a page question (see the module)."""
    lines = text.split("\n")
    counter = [0]
    edits = []
    for section in sections(text):
        quiz = quiz_block(section)
        if quiz is None:
            continue
        try:
            asked = questions(quiz)
        except ValueError:
            continue  # a mark the parser refuses: tests/course/test_sections.py says which; shown as written
        if not any(q.kind != "open" for q in asked):
            continue
        n_body = len(section.body.split("\n"))
        n_quiz = len(quiz.split("\n"))
        start = (
            section.line + n_body - n_quiz
        )  # the heading is line `section.line` (from 1): its body follows
        edits.append((start, start + n_quiz, _quiz_lines(lines[start : start + n_quiz], asked, counter)))
    for start, end, new in reversed(edits):
        lines[start:end] = new
    return "\n".join(lines)
