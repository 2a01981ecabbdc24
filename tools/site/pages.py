"""The site's pages, staged from the sources: chapters, lessons, labs, the home page (with the README's course
map), and the navigation that orders them (module -> chapter -> lesson -> lab).

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
from .paths import ROOT, chapter_files, module_of, page_for

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
        raise SystemExit("README.md has no 'Course map' section to put on the home page")
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
    """Chapters: copies with links rewritten (math is converted later, by the Markdown extension)."""
    chapters = []
    for path in chapter_files():
        rel = f"course/{path.name}"
        docs_path = page_for(rel)
        text = path.read_text(encoding="utf-8")
        staged = Rewriter(rel, docs_path, broken, docs=docs).rewrite(text)
        (docs / docs_path).write_text(markdown_in_details(staged), encoding="utf-8")
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


def stage_home(docs: Path, broken: list[dict], sources: dict[str, str]) -> str:
    """Home: the README's opening and its course map, links pointed at the site's pages; returns the map."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    course_map = readme_course_map(readme)
    intro = readme.split("\n## ", 1)[0]
    home = Rewriter("README.md", "index.md", broken, docs=docs)
    (docs / "index.md").write_text(
        home.rewrite(intro)
        + "\n\n## Course map\n\n"
        + home.rewrite(course_map)
        + "\n\nAlso here: [the engine's API](api.md)"
        + (", [the glossary](chapters/glossary.md)" if (ROOT / "course/glossary.md").exists() else "")
        + ", and every file of the repository under [source](source/index.html).\n",
        encoding="utf-8",
    )
    sources["index.md"] = "README.md"
    return course_map


def navigation(chapters: list[Staged], lessons: list[Staged], labs: list[Staged], course_map: str) -> list:
    """mkdocs' ``nav``: Home, one section per module (its chapters, lessons, lab), the glossary, the API."""
    titles = module_titles(course_map)
    by_module: dict[int, list] = {}
    for kind, items in (("chapter", chapters), ("lesson", lessons), ("lab", labs)):
        for path, docs_path, title in items:
            key = path.parent.name[3:] if kind == "lab" else path.name
            num = module_of(key)
            if num is None:
                continue
            if kind == "lesson":
                title = f"Lesson {num}: {title}"
            by_module.setdefault(num, []).append({title: docs_path})
    nav: list = [{"Home": "index.md"}]
    for num in sorted(by_module):
        name = titles.get(num, "")
        nav.append({f"Module {num}{' · ' + name if name else ''}": by_module[num]})
    glossary = [d for p, d, _ in chapters if p.name == "glossary.md"]
    if glossary:
        nav.append({"Glossary 术语表": glossary[0]})
    nav.append({"API": "api.md"})
    return nav
