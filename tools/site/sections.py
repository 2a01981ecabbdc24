"""A chapter as a learner reads it: sections of one sitting, each opening with its takeaway and ending with a
short quiz, and the quiz questions a page can check.

The rules, which ``tests/course/test_sections.py`` enforces and the site's quiz pages build on:

- Every ``## `` heading of a chapter opens a *section*. A section takes at most ``MAX_MINUTES`` to read at
  ``CHARS_PER_MINUTE``: a conservative rate for zh-CN technical text with formulas and code (fluent readers
  of plain Chinese prose manage 300-500 characters a minute). Answers in ``<details>`` blocks, source lines
  and HTML comments are not counted: a learner reads them after trying the question, or not at all.
- A section's first line under its heading is its takeaway, ``> **要点**：…``.
- A section ends with ``### 小测``: two or three numbered questions, each followed by a ``<details>`` block
  whose summary is 答案 (answer) or 提示 (hint). At least one of them can be checked by the page, marked at the
  end of the question's first line:

      1. 哪一份数据留在 CPU 内存里？ <!-- quiz: choice C -->

          - A. fp16 参数
          - B. fp16 梯度
          - C. fp32 主权重和 Adam 的 m、v

      <details><summary>答案</summary>

      C。……

      </details>

      2. 13B 参数的模型，混合精度 Adam 的模型状态共多少 GB？ <!-- quiz: number 208 ±1% -->

  ``choice X`` names the right option's letter; ``number V ±T`` accepts V within T (``±0.5``) or within T per
  cent of V (``±2%``). On GitHub the comment is invisible and the question reads as before.
- Frame sections (自测题, 小结, 延伸阅读) keep only the length rule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CHARS_PER_MINUTE = 300
MAX_MINUTES = 25
FRAME_TITLES = ("自测题", "小结", "延伸阅读")
TAKEAWAY = "> **要点**："
QUIZ_HEADING = "### 小测"

FENCE = re.compile(r"^\s*(```+|~~~+)")
DETAILS_BLOCK = re.compile(r"<details.*?</details>", re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
SOURCE_LINE = re.compile(r"^\s*<sub>来源：.*</sub>\s*$", re.M)
QUESTION = re.compile(r"^(\d+)\. (.*)$")
QUIZ_MARK = re.compile(r"<!--\s*quiz:\s*(.*?)\s*-->")
CHOICE = re.compile(r"^choice ([A-Z])$")
NUMBER = re.compile(r"^number (-?[\d.]+(?:e-?\d+)?) ±([\d.]+)(%?)$")
OPTION = re.compile(r"^\s+- ([A-Z])\. (.+)$")
ANSWER = re.compile(r"^\s*<details><summary>\s*(答案|提示)")


@dataclass(frozen=True)
class Section:
    title: str  # the heading's text, without the ##
    line: int  # where the heading is, counted from 1
    body: str  # everything under the heading, up to the next ## heading

    @property
    def is_frame(self) -> bool:
        return any(word in self.title for word in FRAME_TITLES)


@dataclass(frozen=True)
class Question:
    number: int
    text: str  # the first line, without its quiz mark
    kind: str  # "choice", "number" or "open"
    answer: str | None = None  # the option letter, or the number as written
    tolerance: float = 0.0  # for numbers: how far from the answer is still right
    relative: bool = False  # the tolerance is a fraction of the answer
    options: tuple[tuple[str, str], ...] = ()  # (letter, text) of a choice question
    answered: bool = False  # a <details> 答案/提示 block follows it

    def accepts(self, given: str) -> bool:
        """Whether `given` (what a learner typed or picked) is right."""
        if self.kind == "choice":
            return given.strip().upper() == self.answer
        if self.kind == "number":
            try:
                value = float(given.strip().replace(",", ""))
            except ValueError:
                return False
            target = float(self.answer)
            allowed = self.tolerance * abs(target) if self.relative else self.tolerance
            return abs(value - target) <= allowed + 1e-12
        return False


def _outside_fences(lines: list[str]) -> list[bool]:
    inside, flags = False, []
    for line in lines:
        if FENCE.match(line):
            inside = not inside
            flags.append(False)
        else:
            flags.append(not inside)
    return flags


def sections(text: str) -> list[Section]:
    """The ## sections of a chapter, in order (what comes before the first one is the chapter's frame)."""
    lines = text.split("\n")
    starts = [
        i
        for i, (line, prose) in enumerate(zip(lines, _outside_fences(lines), strict=True))
        if prose and line.startswith("## ")
    ]
    found = []
    for n, start in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        found.append(Section(lines[start][3:].strip(), start + 1, "\n".join(lines[start + 1 : end])))
    return found


def reading_minutes(body: str) -> float:
    """Minutes a learner needs for `body` at CHARS_PER_MINUTE, answers, sources and comments left out."""
    text = SOURCE_LINE.sub("", COMMENT.sub("", DETAILS_BLOCK.sub("", body)))
    return len(re.sub(r"\s+", "", text)) / CHARS_PER_MINUTE


def takeaway(section: Section) -> str | None:
    """The section's opening takeaway line, or None."""
    for line in section.body.split("\n"):
        if line.strip():
            return line.strip() if line.startswith(TAKEAWAY) else None
    return None


def quiz_block(section: Section) -> str | None:
    """The text of the section's closing ### 小测, or None where it has none or it is not the last ###."""
    lines = section.body.split("\n")
    prose = _outside_fences(lines)
    heads = [i for i, line in enumerate(lines) if prose[i] and line.startswith("### ")]
    if not heads or lines[heads[-1]].strip() != QUIZ_HEADING:
        return None
    return "\n".join(lines[heads[-1] + 1 :])


def _parse_mark(mark: str) -> dict:
    if m := CHOICE.match(mark):
        return {"kind": "choice", "answer": m.group(1)}
    if m := NUMBER.match(mark):
        percent = bool(m.group(3))
        return {
            "kind": "number",
            "answer": m.group(1),
            "tolerance": float(m.group(2)) / (100 if percent else 1),
            "relative": percent,
        }
    raise ValueError(f"a quiz mark this course cannot read: {mark!r} (choice X, or number V ±T[%])")


def questions(quiz: str) -> list[Question]:
    """The numbered questions of a quiz block (outside the answers), with their marks, options and answers."""
    lines = DETAILS_BLOCK.sub(lambda m: m.group(0).split("\n", 1)[0], quiz).split("\n")
    found: list[dict] = []
    for line in lines:
        if m := QUESTION.match(line):
            mark = QUIZ_MARK.search(m.group(2))
            fields = _parse_mark(mark.group(1)) if mark else {"kind": "open"}
            text = QUIZ_MARK.sub("", m.group(2)).strip()
            found.append({"number": int(m.group(1)), "text": text, "options": [], **fields})
        elif found and (m := OPTION.match(line)):
            found[-1]["options"].append((m.group(1), m.group(2).strip()))
        elif found and ANSWER.match(line):
            found[-1]["answered"] = True
    result = []
    for q in found:
        q["options"] = tuple(q["options"])
        question = Question(**q)
        if question.kind == "choice" and question.answer not in {letter for letter, _ in question.options}:
            raise ValueError(
                f"question {question.number}: answer {question.answer} is not one of its options"
            )
        result.append(question)
    return result
