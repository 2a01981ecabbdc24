"""The site's pages, staged from the sources: chapters, lessons, labs, the README, the home page (the course's
front door in Chinese, from ``home.zh.md`` and the chapters' time estimates), and the navigation that orders them
(module -> chapter -> lesson -> lab -> appendix).

Each ``stage_*`` function writes its staged copies under the docs tree, records which repository file each page
comes from in ``sources`` (for the "source" link on the page) and appends the links that do not resolve to
``broken`` (for the build's report). The sources themselves are never edited.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .links import Rewriter
from .mathml import MATH_RE, math_html
from .paths import ROOT, chapter_files, is_appendix, module_of, page_for
from .quiz import quiz_markdown

# One staged page: (its source file, its docs path, its title).
Staged = tuple[Path, str, str]


def first_heading(text: str) -> str | None:
    m = re.search(r"^#\s+(.+?)\s*#*\s*$", text, re.M)
    return m.group(1).strip() if m else None


def readme_course_map(readme: str) -> str:
    """The README's course-map section (its heading and body up to the next level-2 heading)."""
    m = re.search(r"^##\s+Course map\s*$(.*?)(?=^##\s)", readme, re.M | re.S)
    if not m:
        m = re.search(r"^##\s+[^\n]*(?:map|课程)[^\n]*$(.*?)(?=^##\s|\Z)", readme, re.M | re.S | re.I)
    if not m:
        raise SystemExit(
            "README.md has no 'Course map' section: its first column names the modules in the navigation"
        )
    return m.group(1).strip()


def module_titles(course_map: str) -> dict[int, str]:
    """Module number -> its name in the course map's first column (e.g. 'basics 基础篇')."""
    titles = {}
    for row in course_map.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        m = re.match(r"(\d+)\s+(.+)", cells[0]) if cells else None
        if m:
            titles.setdefault(int(m.group(1)), m.group(2))  # the module's first row, not a "(continued)" one
    return titles


def stage_notebook(src: Path, docs: Path, rel: str, docs_path: str, broken: list[dict]) -> str:
    nb = json.loads(src.read_text(encoding="utf-8"))
    rw = Rewriter(rel, docs_path, broken, final_urls=True, docs=docs)
    title = None
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "markdown":
            continue
        text = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        title = title or first_heading(text)
        text = rw.rewrite(text)
        text = MATH_RE.sub(math_html, text)
        cell["source"] = text
    (docs / docs_path).write_text(json.dumps(nb, ensure_ascii=False), encoding="utf-8")
    return title or src.stem


DETAILS = re.compile(r"^( +)<details>(.*?)^\1</details>[ \t]*$", re.M | re.S)


def markdown_in_details(text: str) -> str:
    """The answers' `<details>` blocks as Markdown (md_in_html). GitHub renders Markdown inside them; Python-Markdown
    leaves a raw HTML block as it is unless told, and sees one only at the left margin, so a block indented under a
    question's list item moves out to it (`sane_lists` in mkdocs.yml keeps the next question's number)."""

    def dedent(m: re.Match) -> str:
        indent = len(m.group(1))
        body = "\n".join(
            line[indent:] if line.startswith(" " * indent) else line for line in m.group(2).split("\n")
        )
        return f"<details>{body}</details>"

    return DETAILS.sub(dedent, text).replace("<details>", '<details markdown="1">')


def stage_chapters(docs: Path, broken: list[dict], sources: dict[str, str]) -> list[Staged]:
    """Chapters: copies with links rewritten and their quizzes made answerable in the page (``quiz.py``); math is
    converted later, by the Markdown extension."""
    chapters = []
    for path in chapter_files():
        rel = f"course/{path.name}"
        docs_path = page_for(rel)
        text = path.read_text(encoding="utf-8")
        staged = Rewriter(rel, docs_path, broken, docs=docs).rewrite(text)
        (docs / docs_path).write_text(markdown_in_details(quiz_markdown(staged)), encoding="utf-8")
        sources[docs_path] = rel
        chapters.append((path, docs_path, first_heading(text) or path.stem))
    return chapters


def stage_lessons(docs: Path, broken: list[dict], sources: dict[str, str]) -> list[Staged]:
    """Lessons: the executed notebooks, outputs as stored (links and math in Markdown cells converted)."""
    lessons = []
    for path in sorted((ROOT / "lessons").glob("*.ipynb")):
        rel = f"lessons/{path.name}"
        docs_path = page_for(rel)
        title = stage_notebook(path, docs, rel, docs_path, broken)
        sources[docs_path] = rel
        lessons.append((path, docs_path, title))
    return lessons


def stage_labs(docs: Path, broken: list[dict], sources: dict[str, str]) -> list[Staged]:
    """Labs: each README, with the command that grades it on top."""
    labs = []
    for path in sorted(
        (ROOT / "labs").glob("lab*/README.md"), key=lambda p: module_of(p.parent.name[3:]) or 0
    ):
        lab = path.parent.name
        rel = f"labs/{lab}/README.md"
        docs_path = page_for(rel)
        text = Rewriter(rel, docs_path, broken, docs=docs).rewrite(path.read_text(encoding="utf-8"))
        command = f"make {lab}"
        grade = f'!!! tip "Grade it"\n    From the repository root: `{command}` (`LAB_DIR=solutions {command}` grades the reference).\n\n'
        # The default argument binds this lab's box (a bare closure would see the loop's last one: B023).
        text = re.sub(r"^(#\s[^\n]*\n)", lambda m, g=grade: m.group(1) + "\n" + g, text, count=1, flags=re.M)
        if not text.lstrip().startswith("#"):
            text = grade + text
        (docs / docs_path).write_text(text, encoding="utf-8")
        sources[docs_path] = rel
        labs.append((path, docs_path, first_heading(text) or lab))
    return labs


HOME_TEMPLATE = Path(__file__).with_name("home.zh.md")
TIME_LINE = "**预计用时**："


def time_estimate(text: str) -> str | None:
    """A chapter's 预计用时 (time estimate), as its opening block states it (the line and its continuation)."""
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(TIME_LINE):
            found = [line[len(TIME_LINE) :].strip()]
            for more in lines[i + 1 :]:
                if not more.strip():
                    break
                ascii_edge = re.search(r"[A-Za-z0-9.,;:)]$", found[-1]) and re.match(
                    r"[A-Za-z0-9(`]", more.strip()
                )
                glue = " " if ascii_edge else ""  # a line break between Chinese characters is no space
                found[-1] += glue + more.strip()
            return _first_sentence(re.sub(r"\[([^\]]+)\]\[[^\]]*\]", r"\1", found[0]))
    return None


def _first_sentence(text: str) -> str:
    """Up to the first 。 outside brackets: the estimate, without the prose a chapter may continue it with (a
    reference-style link, whose definition is the chapter's, was made plain text above)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "（("
        depth -= ch in "）)"
        if ch == "。" and depth <= 0:
            return text[: i + 1]
    return text


def _module_route(num: int, items: list[tuple[str, Staged]], docs: Path, broken: list[dict]) -> str:
    """The home page's part of one module: its chapters (with their time estimates), lesson, lab, appendices."""
    parts = {"chapter": "章节", "lesson": "笔记本", "lab": "实验", "appendix": "附录（选读）"}
    out = [f"### 模块 {num}", ""]
    for kind, (path, docs_path, title) in items:
        line = f"- {parts[kind]}：[{title}]({docs_path})"
        if kind == "lab":
            line += f"，`make {path.parent.name}` 评分"
        if kind == "chapter":
            when = time_estimate(path.read_text(encoding="utf-8"))
            if when:
                rel = f"course/{path.name}"
                line += f"  \n  预计用时：{Rewriter(rel, 'index.md', broken, docs=docs).rewrite(when)}"
        out.append(line)
    return "\n".join(out)


def stage_home(
    docs: Path, broken: list[dict], sources: dict[str, str], chapters: list[Staged], lessons, labs
) -> None:
    """Home: the course's front door in Chinese (``home.zh.md``), with the path through the modules built from
    the staged pages (each chapter's 预计用时 read from the chapter, so it stays true)."""
    by_module = _by_module(chapters, lessons, labs)
    route = "\n\n".join(_module_route(num, by_module[num], docs, broken) for num in sorted(by_module))
    glossary = [d for p, d, _ in chapters if p.name == "glossary.md"]
    fields = {
        "route": route,
        "readme": "readme.md",
        "api": "api.md",
        "source": "source/index.html",
        "glossary": f"- [术语表]({glossary[0]})：每个概念一个名字，中英对照。\n" if glossary else "",
    }
    text = HOME_TEMPLATE.read_text(encoding="utf-8")
    for key, value in fields.items():
        text = text.replace("{" + key + "}", value)
    (docs / "index.md").write_text(text, encoding="utf-8")
    sources["index.md"] = HOME_TEMPLATE.relative_to(ROOT).as_posix()


def stage_readme(docs: Path, broken: list[dict], sources: dict[str, str]) -> str:
    """The README (English: the engine's story, the commands, the layout) as a page; returns its course map, whose
    first column names the modules in the navigation."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    docs_path = page_for("README.md")
    (docs / docs_path).write_text(
        Rewriter("README.md", docs_path, broken, docs=docs).rewrite(readme), encoding="utf-8"
    )
    sources[docs_path] = "README.md"
    return readme_course_map(readme)


def _by_module(chapters: list[Staged], lessons: list[Staged], labs: list[Staged]) -> dict[int, list]:
    """Module number -> its pages in reading order: chapters, lesson, lab, then the chapters' appendices (detours
    a learner takes from a link, not on the main path)."""
    by_module: dict[int, list] = {}
    for kind, items in (("chapter", chapters), ("lesson", lessons), ("lab", labs)):
        for staged in items:
            path = staged[0]
            num = module_of(path.parent.name[3:] if kind == "lab" else path.name)
            if num is not None:
                by_module.setdefault(num, []).append((kind, staged))
    for num, items in by_module.items():
        main = [(k, s) for k, s in items if not (k == "chapter" and is_appendix(s[0].name))]
        by_module[num] = main + [
            ("appendix", s) for k, s in items if k == "chapter" and is_appendix(s[0].name)
        ]
    return by_module


def navigation(chapters: list[Staged], lessons: list[Staged], labs: list[Staged], course_map: str) -> list:
    """mkdocs' ``nav``: Home, one section per module (its chapters, lesson, lab, appendices), the glossary, the
    README, the API."""
    titles = module_titles(course_map)
    nav: list = [{"首页 Home": "index.md"}]
    for num, items in sorted(_by_module(chapters, lessons, labs).items()):
        entries = []
        for kind, (_, docs_path, title) in items:
            if kind == "lesson":
                title = f"Lesson {num}: {title}"
            elif kind == "appendix" and "附录" not in title and "appendix" not in title.lower():
                title = f"附录 · {title}"
            entries.append({title: docs_path})
        name = titles.get(num, "")
        nav.append({f"Module {num}{' · ' + name if name else ''}": entries})
    glossary = [d for p, d, _ in chapters if p.name == "glossary.md"]
    if glossary:
        nav.append({"Glossary 术语表": glossary[0]})
    nav.append({"README (English)": page_for("README.md")})
    nav.append({"API": "api.md"})
    return nav
