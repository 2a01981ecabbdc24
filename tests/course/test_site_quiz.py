"""The sections' quizzes on the site: a checkable question becomes a radio group or a number box with a 检查
button, its answer in data attributes that match the parser's, its explanation (the <details>) inside the same
block, and the page script checks numbers with the rule of ``Question.accepts``.

A temporary chapter is staged the way the real ones are (``stage_chapters``) and rendered with the site's own
Markdown extensions (mkdocs.yml); the whole site is not built here (``test_site.py`` does that).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("material")

from tools.site import pages  # noqa: E402
from tools.site.mathml import make_math_extension  # noqa: E402
from tools.site.quiz import quiz_markdown  # noqa: E402
from tools.site.sections import questions, quiz_block, sections  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUIZ_JS = ROOT / "tools" / "site" / "assets" / "quiz.js"

CHAPTER = """\
# 第 9 章 测试章

> **Abstract.** A chapter to stage.

## 9.1 一节

> **要点**：一句话。

正文。

### 小测

1. 哪一份数据留在 CPU 内存里？ <!-- quiz: choice C -->

    - A. fp16 参数
    - B. fp16 梯度，`grad` 和 $\\Psi$
    - C. fp32 主权重和 Adam 的 m、v

<details><summary>答案</summary>

C。A 和 B 留在 GPU 上。

1. 答案里的编号不是题目

</details>

2. 13B 参数的模型，混合精度 Adam 的模型状态共多少 GB？ <!-- quiz: number 208 ±1% -->

<details><summary>答案</summary>

13 × 16 = 208。

</details>

3. 为什么？

<details><summary>提示</summary>

想一想。

</details>

## 9.2 第二节

> **要点**：又一句。

### 小测

1. 带宽是多少 GB/s？ <!-- quiz: number 1.5 ±0.05 -->

    <details><summary>答案</summary>

    1.5。

    </details>

2. 选一个。 <!-- quiz: choice A -->

    - A. 对
    - B. 错

<details><summary>答案</summary>

A。

</details>

## 9.9 小结

没有小测。
"""


class _Blocks(HTMLParser):
    """The quiz blocks of a page: their attributes, inputs, buttons and details, in order."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.blocks: list[dict] = []
        self.depth = 0  # <div> nesting inside the current block
        self.in_details = self.in_button = False
        self.ol_starts: list[int] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "ol":
            self.ol_starts.append(int(a.get("start", 1)))
        if tag == "div" and "zo-quiz" in (a.get("class") or "").split():
            self.blocks.append({"attrs": a, "inputs": [], "buttons": [], "details": "", "text": ""})
            self.depth = 1
            return
        if not self.depth:
            return
        block = self.blocks[-1]
        if tag == "div":
            self.depth += 1
        elif tag == "input":
            block["inputs"].append(a)
        elif tag == "button":
            block["buttons"].append("")
            self.in_button = True
        elif tag == "details":
            self.in_details = True

    def handle_endtag(self, tag):
        if self.depth and tag == "div":
            self.depth -= 1
        elif tag == "details":
            self.in_details = False
        elif tag == "button":
            self.in_button = False

    def handle_data(self, data):
        if not self.depth:
            return
        block = self.blocks[-1]
        if self.in_details:
            block["details"] += data
        elif self.in_button:
            block["buttons"][-1] += data
        block["text"] += data


def render(markdown_text: str) -> str:
    """HTML as mkdocs makes it from a staged page: mkdocs.yml's extensions, plus the site's math."""
    import markdown
    from mkdocs.config import load_config

    cfg = load_config(str(ROOT / "mkdocs.yml"), docs_dir=str(ROOT / "course"))
    md = markdown.Markdown(
        extensions=[*cfg.markdown_extensions, make_math_extension()], extension_configs=cfg.mdx_configs
    )
    return md.convert(markdown_text)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """The temporary chapter, staged by stage_chapters as if it were course/09-quiz.md, and rendered."""
    tmp = tmp_path_factory.mktemp("quiz")
    (tmp / "course").mkdir()
    source = tmp / "course" / "09-quiz.md"
    source.write_text(CHAPTER, encoding="utf-8")
    docs = tmp / "docs"
    (docs / "chapters").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pages, "chapter_files", lambda: [source])
        mp.setattr(pages, "page_for", lambda rel: f"chapters/{Path(rel).name}")
        broken, sources = [], {}
        staged = pages.stage_chapters(docs, broken, sources)
    assert staged == [(source, "chapters/09-quiz.md", "第 9 章 测试章")] and not broken
    text = (docs / "chapters" / "09-quiz.md").read_text(encoding="utf-8")
    parser = _Blocks()
    parser.feed(render(text))
    return text, parser


def checkable():
    return [
        q
        for s in sections(CHAPTER)
        if quiz_block(s) is not None
        for q in questions(quiz_block(s))
        if q.kind != "open"
    ]


def test_each_checkable_question_becomes_a_form_with_the_parsers_answer(staged):
    _, parser = staged
    asked = checkable()
    assert len(parser.blocks) == len(asked) == 4
    for block, q in zip(parser.blocks, asked, strict=True):
        a = block["attrs"]
        assert a["data-quiz"] == q.kind and a["data-answer"] == q.answer
        assert block["buttons"] == ["检查"]
        assert q.text in block["text"]  # the question keeps its text
        if q.kind == "choice":
            radios = [i for i in block["inputs"] if i.get("type") == "radio"]
            assert [r["value"] for r in radios] == [letter for letter, _ in q.options]
            assert len({r["name"] for r in radios}) == 1
            for letter, text in q.options:
                plain = re.sub(r"`|\$[^$]*\$", "", text).strip()
                assert f"{letter}. {plain[:6]}" in block["text"]
        else:
            assert float(a["data-tolerance"]) == q.tolerance
            assert a["data-relative"] == ("1" if q.relative else "0")
            assert [i.get("class") for i in block["inputs"]] == ["zo-quiz-number"]
    names = [i["name"] for b in parser.blocks for i in b["inputs"] if i.get("type") == "radio"]
    assert len(set(names)) == 2  # one radio group per choice question, each with its own name


def test_the_explanation_follows_inside_the_block(staged):
    _, parser = staged
    details = [b["details"].strip() for b in parser.blocks]
    assert details[0].startswith("答案") and "A 和 B 留在 GPU 上" in details[0]
    assert "答案里的编号不是题目" in details[0]  # a list inside the answer stays in the answer
    assert "13 × 16 = 208" in details[1]
    assert "1.5。" in details[2]  # an answer indented under its question, too
    assert details[3].endswith("A。")


def test_open_questions_and_numbers_stay_as_written(staged):
    text, parser = staged
    assert "3. 为什么？" in text and "<summary>提示</summary>" in text
    assert "想一想" not in "".join(b["details"] for b in parser.blocks)
    assert "<!-- quiz:" not in text  # the marks are consumed
    assert parser.ol_starts == [
        1,
        1,
        2,
        3,
        1,
        2,
    ]  # each question keeps its number (the 1 after 1: in an answer)
    assert "<code>grad</code>" in render(text) and "<math" in render(text)  # options keep their Markdown


def test_a_chapter_without_marks_is_staged_unchanged():
    plain = CHAPTER.replace("<!-- quiz: choice C -->", "").replace("<!-- quiz: number 208 ±1% -->", "")
    plain = plain.replace("<!-- quiz: number 1.5 ±0.05 -->", "").replace("<!-- quiz: choice A -->", "")
    assert quiz_markdown(plain) == plain
    assert quiz_markdown("# x\n\n## 1.1 a\n\ntext\n") == "# x\n\n## 1.1 a\n\ntext\n"


GIVEN = [
    "208",
    "206",
    "210.08",
    "205.9",
    "210.1",
    " 2,08 ",
    "2.08e2",
    "+208",
    "-208",
    "abc",
    "",
    "208.",
    "２０８",
]


@pytest.mark.skipif(not shutil.which("node"), reason="node is not installed")
def test_the_page_script_checks_numbers_like_question_accepts():
    asked = checkable()
    cases = []
    for q in asked:
        data = {
            "quiz": q.kind,
            "answer": q.answer,
            "tolerance": repr(q.tolerance),
            "relative": "1" if q.relative else "0",
        }
        values = (
            GIVEN + ["1.45", "1.55", "1.44", "1.56", "1.5"] if q.kind == "number" else ["A", "c", "C ", "B"]
        )
        cases += [(data, v, q.accepts(v)) for v in values]
    script = (
        f"const {{accepts}} = require({json.dumps(str(QUIZ_JS))});\n"
        f"const cases = {json.dumps([[d, v] for d, v, _ in cases], ensure_ascii=False)};\n"
        "console.log(JSON.stringify(cases.map(([d, v]) => accepts(d, v) === true)));\n"
    )
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    wrong = [(d["answer"], v, want) for (d, v, want), g in zip(cases, got, strict=True) if g != want]
    assert not wrong, wrong
