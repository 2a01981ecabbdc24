"""Staging: everything mkdocs builds from is written under ``out/site-src/docs/``, never into the sources.

The staged tree holds the chapters, lessons and labs with their links rewritten (``pages.py``), the README, the
home page, the API page (``api.py``), the site's stylesheet, the quizzes' script and style (``assets/``), and the
images the pages show (copied under ``files/``). The source pages under ``source/`` are not staged: the mkdocs
hooks add them as generated files (``hooks.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .api import api_markdown
from .links import anchors_of
from .mathml import MATH_PROBLEMS
from .pages import navigation, stage_chapters, stage_home, stage_labs, stage_lessons, stage_readme
from .search import search_terms

# The site's own styles: source links, math, the API page, and a system font stack (``font: false`` in
# mkdocs.yml) that names the common CJK families, so that Chinese text finds a font with its glyphs.
SITE_CSS = """
.zo-source { font-size: .75rem; margin: 0 0 1em; }
.zo-source a { color: var(--md-default-fg-color--light); }
.zo-math-block { display: block; overflow-x: auto; margin: 1em 0; }
.md-typeset math { font-size: 1.1em; }
pre.zo-doc { white-space: pre-wrap; font-size: .8rem; background: var(--md-code-bg-color); padding: .6em .8em; }
pre.zo-sig code { font-weight: 600; }
body, .md-typeset {
  font-family: -apple-system, BlinkMacSystemFont, "Segoe UI", Helvetica, Arial, "Noto Sans CJK SC",
    "Noto Sans SC", "PingFang SC", "Microsoft YaHei", "WenQuanYi Micro Hei", sans-serif;
}
"""


ASSETS = sorted((Path(__file__).parent / "assets").glob("*.*"))


def stage(docs: Path) -> dict:
    """Write the staged docs tree; return the site map (navigation, page -> source, report)."""
    if docs.exists():
        shutil.rmtree(docs)
    for sub in ("chapters", "lessons", "labs", "assets"):
        (docs / sub).mkdir(parents=True, exist_ok=True)
    anchors_of.cache_clear()  # the sources' headings may have changed since the last build in this process
    broken: list[dict] = []
    sources: dict[str, str] = {}  # staged docs path -> repository path
    MATH_PROBLEMS.clear()

    chapters = stage_chapters(docs, broken, sources)
    lessons = stage_lessons(docs, broken, sources)
    labs = stage_labs(docs, broken, sources)
    course_map = stage_readme(docs, broken, sources)
    stage_home(docs, broken, sources, chapters, lessons, labs)
    (docs / "api.md").write_text(api_markdown(), encoding="utf-8")
    sources["api.md"] = "src/zero_offload/__init__.py"
    (docs / "assets" / "site.css").write_text(SITE_CSS, encoding="utf-8")
    for asset in ASSETS:  # the quizzes' script and style (extra_javascript / extra_css in mkdocs.yml)
        shutil.copyfile(asset, docs / "assets" / asset.name)

    return {
        "nav": navigation(chapters, lessons, labs, course_map),
        "sources": sources,
        "broken_links": broken,
        "math_problems": list(MATH_PROBLEMS),  # the notebooks' (the chapters' TeX is converted by mkdocs)
        "terms": search_terms(),
        "chapters": [d for _, d, _ in chapters],
        "lessons": [d for _, d, _ in lessons],
        "labs": [d for _, d, _ in labs],
    }
