"""Build the course as an offline static website: ``make site`` (``out/site/``).

Why mkdocs-material + mkdocs-jupyter: of the three candidates it is the only one whose search segments Chinese
text out of the box (Material's search plugin runs jieba over every page at build time and joins the words with
U+200B, which its separator splits on; the glossary's terms are added to jieba's dictionary so that they stay
whole; lunr's own "zh" language is not used, as it needs jieba in the browser), mkdocs-jupyter renders
``lessons/*.ipynb`` from their stored outputs (``execute: false``) through nbconvert, and the whole theme
(scripts, styles, icons, the lunr search index) ships inside the wheel, so with ``font: false`` nothing is
fetched from the network at build or view time. Sphinx + MyST-NB would need a custom search language for
Chinese, and Jupyter Book adds a second configuration layer over Sphinx. Math is converted from TeX to MathML at
build time (``latex2mathml``, in a small Markdown extension defined here), which browsers render natively: no
MathJax or KaTeX, no CDN. The CDN references mkdocs-jupyter emits by itself (its MathJax script tag and its
mermaid loader, both unused here) are removed after each page is rendered.

How: this script stages the sources under ``out/site-src/docs/`` (the sources themselves are never edited), writes
the navigation (module -> chapter -> lesson -> lab), generates the home page (with the README's course map) and
the API page, then runs ``mkdocs build --strict`` through mkdocs' Python API. The same file is the mkdocs hook
module (``hooks:`` in ``mkdocs.yml``): it adds the math extension, adds source pages under ``source/`` (the
repository's files, highlighted, so that every page's "source" link and every backticked path in the chapters
works offline), puts a source link on every page, and strips CDN script tags.

    python tools/build_site.py [--site-dir out/site] [--staging out/site-src]
"""

from __future__ import annotations

import argparse
import functools
import html
import importlib
import inspect
import json
import logging
import os
import pkgutil
import posixpath
import re
import shutil
import sys
import time
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent
MAP_NAME = "site-map.json"  # written next to the staged docs (not inside them)
log = logging.getLogger("mkdocs.hooks.build_site")

# Chinese terms jieba must keep whole, so that searching for them finds them (jieba alone cuts 梯度分片 in two).
BASE_TERMS = [
    "梯度分片",
    "参数分片",
    "优化器状态分片",
    "分片",
    "卸载",
    "流水线",
    "暂存缓冲区",
    "暂存槽",
    "下行",
    "上行",
    "主权重",
    "模型状态",
    "优化器状态",
    "损失缩放",
    "混合精度",
    "延迟参数更新",
    "激活重计算",
    "模拟设备",
]

# Files under these roots get a highlighted source page under source/ (plus the listed top-level files).
SOURCE_ROOTS = ["course", "labs", "lessons", "solutions", "src", "tools", "tests", "examples"]
SOURCE_TOP = ["README.md", "Makefile", "pyproject.toml", "mkdocs.yml"]
SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".hypothesis", ".ruff_cache"}
SKIP_SUFFIXES = {".pyc", ".so", ".o", ".pt", ".bin", ".ipynb", ".pdf", ".npz", ".npy"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"}  # shown as images on their source page
MAX_SOURCE_BYTES = 400_000


# --------------------------------------------------------------------------------------------------------------
# Mapping repository paths to site paths
# --------------------------------------------------------------------------------------------------------------


def chapter_files() -> list[Path]:
    """course/*.md in chapter order (00-, 01-, ..., 03-, 03a-, ...), the glossary last."""
    files = sorted(p for p in (ROOT / "course").glob("*.md") if re.match(r"\d", p.name))
    glossary = ROOT / "course" / "glossary.md"
    return files + ([glossary] if glossary.exists() else [])


def module_of(name: str) -> int | None:
    m = re.match(r"(\d+)", name)
    return int(m.group(1)) if m else None


def page_for(rel: str) -> str | None:
    """The staged docs path of the site page that renders repository path ``rel`` (or None)."""
    rel = rel.rstrip("/")
    p = ROOT / rel
    if rel == "README.md":
        return "index.md"
    m = re.fullmatch(r"course/([^/]+\.md)", rel)
    if m and p.is_file():
        return f"chapters/{m.group(1)}"
    m = re.fullmatch(r"lessons/([^/]+)\.ipynb", rel)
    if m and p.is_file():
        return f"lessons/{m.group(1)}.ipynb"
    m = re.fullmatch(r"labs/(lab\d+)(/README\.md)?", rel)
    if m and (ROOT / "labs" / m.group(1) / "README.md").is_file():
        return f"labs/{m.group(1)}.md"
    return None


def source_page_for(rel: str) -> str | None:
    """The site path of the highlighted source page (or directory listing) of repository path ``rel``."""
    rel = rel.rstrip("/")
    p = ROOT / rel
    if not rel or not p.exists() or not _source_allowed(rel):
        return None
    if p.is_dir():
        return f"source/{rel}/index.html"
    if p.suffix in SKIP_SUFFIXES or p.name.startswith(".") or p.stat().st_size > MAX_SOURCE_BYTES:
        return None
    return f"source/{rel}.html"


def _source_allowed(rel: str) -> bool:
    parts = rel.split("/")
    if SKIP_PARTS.intersection(parts):
        return False
    if len(parts) == 1:
        return rel in SOURCE_TOP or (rel in SOURCE_ROOTS and (ROOT / rel).is_dir())
    return parts[0] in SOURCE_ROOTS


def target_for(rel: str) -> str | None:
    """Where a link to repository path ``rel`` should point: its page, else its source page."""
    return page_for(rel) or source_page_for(rel)


def as_url(docs_path: str) -> str:
    """The built URL of a staged docs path (use_directory_urls is off)."""
    if docs_path.endswith(".md"):
        return docs_path[:-3] + ".html"
    if docs_path.endswith(".ipynb"):
        return docs_path[:-6] + ".html"
    return docs_path


def rel_link(from_docs_path: str, to_path: str) -> str:
    return posixpath.relpath(to_path, posixpath.dirname(from_docs_path) or ".")


# --------------------------------------------------------------------------------------------------------------
# Rewriting links in the staged copies
# --------------------------------------------------------------------------------------------------------------

FENCE_RE = re.compile(r"^\s*(```+|~~~+)")
LINK_RE = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)(\s+\"[^\"]*\")?\)")
CODE_RE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
IMG_TAG_RE = re.compile(r"(<img\b[^>]*\bsrc=\")([^\"]+)(\")", re.I)
ASSET_SUFFIXES = {".png", ".svg", ".jpg", ".jpeg", ".gif", ".webp", ".pdf", ".json", ".csv", ".txt"}
PATHLIKE_RE = re.compile(r"^[A-Za-z0-9_.][\w.\-/]*$")


class Rewriter:
    """Rewrites one Markdown source's links for the site; records the links that do not resolve."""

    def __init__(
        self,
        src_rel: str,
        docs_path: str,
        broken: list[dict],
        final_urls: bool = False,
        docs: Path | None = None,
    ):
        self.docs = docs  # the staged docs tree, where linked images and other assets are copied
        self.src_rel = src_rel  # repository path of the source file
        self.docs_path = docs_path  # where its staged copy lives in the docs tree
        self.broken = broken
        self.final_urls = final_urls  # notebooks: links go to built .html pages, not to .md sources

    def _href(self, target_docs: str) -> str:
        if self.final_urls:
            return rel_link(as_url(self.docs_path), as_url(target_docs))
        return rel_link(self.docs_path, target_docs)

    def resolve_link(self, target: str) -> str | None:
        """The site href for a Markdown link target written in the source, or None if it does not resolve."""
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            return target
        if target.startswith("#"):
            if self.src_rel.endswith((".md", ".ipynb")) and unquote(target[1:]) not in anchors_of(
                self.src_rel
            ):
                return None
            return target
        path, _, anchor = target.partition("#")
        base = posixpath.dirname(self.src_rel)
        rel = posixpath.normpath(posixpath.join(base, path))
        if rel.startswith("..") or not (ROOT / rel).exists():
            return None
        page = page_for(rel)
        if page:
            if anchor and unquote(anchor) not in anchors_of(rel):
                # The page exists, the heading does not: link the page and report the anchor.
                self.broken.append({"source": self.src_rel, "target": target, "text": "(anchor only)"})
                anchor = ""
            return self._href(page) + (f"#{anchor}" if anchor else "")
        if (ROOT / rel).is_file() and Path(rel).suffix.lower() in ASSET_SUFFIXES:
            return self._href(self.copy_asset(rel))
        src = source_page_for(rel)
        return self._href(src) if src else None

    def copy_asset(self, rel: str) -> str:
        """Copy an image (or other binary) the page shows into the docs tree; its docs path."""
        docs_path = f"files/{rel}"
        if self.docs is not None:
            dest = self.docs / docs_path
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest)
        return docs_path

    def resolve_code_path(self, text: str) -> str | None:
        """The href for a backticked repository path such as `src/zero_offload/practice/dpu.py` (or None)."""
        text = re.sub(r":\d+(-\d+)?$", "", text.strip())
        if not PATHLIKE_RE.match(text) or ("/" not in text and "." not in text) or text.startswith("."):
            return None
        if text.endswith((".json", ".png", ".pt", ".txt", ".csv")) and not (ROOT / text).exists():
            return None
        base = posixpath.dirname(self.src_rel)
        candidates = []
        if self.src_rel.startswith("labs/"):
            candidates.append(posixpath.join(base, text))
        candidates += [text, f"src/zero_offload/{text}"]
        for cand in candidates:
            cand = posixpath.normpath(cand).rstrip("/")
            if cand in ("", ".") or cand.startswith(".."):
                continue
            if (ROOT / cand).exists() and ("/" in cand or (ROOT / cand).is_file()):
                if (ROOT / cand).is_file() and Path(cand).suffix.lower() in ASSET_SUFFIXES - {
                    ".json",
                    ".txt",
                }:
                    return self._href(self.copy_asset(cand))
                target = target_for(cand)
                if target:
                    return self._href(target)
        return None

    def rewrite_line(self, line: str) -> str:
        out, pos = [], 0
        for m in LINK_RE.finditer(line):
            out.append(self._code_links(line[pos : m.start()]))
            bang, text, target, title = m.group(1), m.group(2), m.group(3), m.group(4) or ""
            href = self.resolve_link(target)
            if href is None:
                self.broken.append({"source": self.src_rel, "target": target, "text": text})
                out.append(text if not bang else f"`{target}`")
            else:
                out.append(f"{bang}[{text}]({href}{title})")
            pos = m.end()
        out.append(self._code_links(line[pos:]))
        return IMG_TAG_RE.sub(self._img_tag, "".join(out))

    def _img_tag(self, m: re.Match) -> str:
        href = self.resolve_link(m.group(2))
        if href is None:
            self.broken.append({"source": self.src_rel, "target": m.group(2), "text": "<img>"})
            return m.group(0)
        return m.group(1) + href + m.group(3)

    def _code_links(self, segment: str) -> str:
        def repl(m: re.Match) -> str:
            href = self.resolve_code_path(m.group(1))
            return f"[`{m.group(1)}`]({href})" if href else m.group(0)

        return CODE_RE.sub(repl, segment)

    def rewrite(self, text: str) -> str:
        lines, fence = [], None
        for line in text.split("\n"):
            m = FENCE_RE.match(line)
            if fence:
                if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                    fence = None
                lines.append(line)
            elif m:
                fence = m.group(1)
                lines.append(line)
            elif line.startswith(("    ", "\t")) and lines and not lines[-1].strip():
                lines.append(line)  # an indented code block
            else:
                lines.append(self.rewrite_line(line))
        return "\n".join(lines)


def _heading_text(md_text: str) -> str:
    """A Markdown heading's text as the toc extension sees it: no code ticks, link targets or emphasis marks."""
    text = re.sub(r"\s*\{[^}]*\}\s*$", "", md_text)  # attr_list
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|__|\*|_(?=\S)(?<=\s_)|~~)", "", text)
    return html.unescape(text).strip()


@functools.cache
def anchors_of(rel: str) -> frozenset[str]:
    """The heading ids (and explicit ids) the page of repository path ``rel`` will have."""
    from pymdownx.slugs import slugify

    slug = slugify(case="lower")
    path = ROOT / rel
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8")).get("cells", [])
        text = "\n\n".join(
            "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in cells
            if c.get("cell_type") == "markdown"
        )
        first = "section"
    elif path.is_dir():
        path = path / "README.md"
        text, first = path.read_text(encoding="utf-8"), "_"
    else:
        text, first = path.read_text(encoding="utf-8"), "_"
    ids, seen, fence = set(), {}, None
    for line in text.split("\n"):
        m = FENCE_RE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        ids.update(re.findall(r"""\b(?:id|name)=["']([^"']+)["']""", line))
        h = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not h:
            continue
        explicit = re.search(r"\{[^}]*#([\w-]+)[^}]*\}\s*$", h.group(1))
        if explicit:
            ids.add(explicit.group(1))
            continue
        base = slug(_heading_text(h.group(1)), "-") or first
        n = seen.get(base, 0)
        seen[base] = n + 1
        ids.add(base if n == 0 else f"{base}_{n}")
    return frozenset(ids)


# --------------------------------------------------------------------------------------------------------------
# Math: TeX -> MathML at build time
# --------------------------------------------------------------------------------------------------------------

MATH_RE = re.compile(
    r"(?<![\\$])\$\$(?P<d1>.+?)\$\$"
    r"|\\\[(?P<d2>.+?)\\\]"
    r"|\\\((?P<i2>.+?)\\\)"
    r"|(?<![\\$A-Za-z0-9])\$(?![\s$])(?P<i1>[^$\n]+?)(?<![\s\\])\$(?![$0-9A-Za-z])",
    re.S,
)
MATH_PROBLEMS: list[dict] = []


def tex_to_mathml(tex: str, display: bool) -> str | None:
    from latex2mathml.converter import convert

    try:
        return convert(tex.strip(), display="block" if display else "inline")
    except Exception as exc:  # latex2mathml raises many types; keep the TeX visible instead
        MATH_PROBLEMS.append({"tex": tex, "error": f"{type(exc).__name__}: {exc}"})
        return None


def math_html(m: re.Match) -> str:
    display = m.group("d1") is not None or m.group("d2") is not None
    tex = next(g for g in (m.group("d1"), m.group("d2"), m.group("i1"), m.group("i2")) if g is not None)
    mathml = tex_to_mathml(tex, display)
    if mathml is None:
        return f'<code class="zo-tex">{html.escape(tex)}</code>'
    return f'<span class="zo-math{" zo-math-block" if display else ""}">{mathml}</span>'


def make_math_extension():
    from markdown.extensions import Extension
    from markdown.inlinepatterns import InlineProcessor

    class MathInline(InlineProcessor):
        def handleMatch(self, m, data):  # noqa: N802 (Markdown's API)
            return self.md.htmlStash.store(math_html(m)), m.start(0), m.end(0)

    class MathExtension(Extension):
        def extendMarkdown(self, md):  # noqa: N802
            # After code spans (190), before backslash escapes (180), so \( ... \) reaches us intact.
            md.inlinePatterns.register(MathInline(MATH_RE.pattern, md), "zo_math", 185)

    return MathExtension()


# --------------------------------------------------------------------------------------------------------------
# Staging
# --------------------------------------------------------------------------------------------------------------


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


def stage(docs: Path) -> dict:
    """Write the staged docs tree; return the site map (navigation, page -> source, report)."""
    if docs.exists():
        shutil.rmtree(docs)
    for sub in ("chapters", "lessons", "labs", "assets"):
        (docs / sub).mkdir(parents=True, exist_ok=True)
    anchors_of.cache_clear()
    broken: list[dict] = []
    sources: dict[str, str] = {}  # staged docs path -> repository path
    MATH_PROBLEMS.clear()

    # Chapters: copies with links rewritten (math is converted by the Markdown extension).
    chapters = []
    for path in chapter_files():
        rel = f"course/{path.name}"
        docs_path = page_for(rel)
        text = path.read_text(encoding="utf-8")
        (docs / docs_path).write_text(
            Rewriter(rel, docs_path, broken, docs=docs).rewrite(text), encoding="utf-8"
        )
        sources[docs_path] = rel
        chapters.append((path, docs_path, first_heading(text) or path.stem))

    # Lessons: the executed notebooks, outputs as stored (links and math in Markdown cells converted).
    lessons = []
    for path in sorted((ROOT / "lessons").glob("*.ipynb")):
        rel = f"lessons/{path.name}"
        docs_path = page_for(rel)
        title = stage_notebook(path, docs, rel, docs_path, broken)
        sources[docs_path] = rel
        lessons.append((path, docs_path, title))

    # Labs: each README, with the command that grades it on top.
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
        text = re.sub(r"^(#\s[^\n]*\n)", lambda m, g=grade: m.group(1) + "\n" + g, text, count=1, flags=re.M)
        if not text.lstrip().startswith("#"):
            text = grade + text
        (docs / docs_path).write_text(text, encoding="utf-8")
        sources[docs_path] = rel
        labs.append((path, docs_path, first_heading(text) or lab))

    # Home: the README's opening and its course map, links pointed at the site's pages.
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

    (docs / "api.md").write_text(api_markdown(), encoding="utf-8")
    sources["api.md"] = "src/zero_offload/__init__.py"
    (docs / "assets" / "site.css").write_text(SITE_CSS, encoding="utf-8")

    # Navigation: module -> chapter(s) -> lesson(s) -> lab.
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

    terms = list(BASE_TERMS) + glossary_terms()
    return {
        "nav": nav,
        "sources": sources,
        "broken_links": broken,
        "math_problems": list(MATH_PROBLEMS),
        "terms": sorted(set(terms), key=len, reverse=True),
        "chapters": [d for _, d, _ in chapters],
        "lessons": [d for _, d, _ in lessons],
        "labs": [d for _, d, _ in labs],
    }


def glossary_terms() -> list[str]:
    """Chinese terms named in course/glossary.md: the tables' first cells and bold spans (CJK runs only)."""
    path = ROOT / "course" / "glossary.md"
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    found = []
    for line in text.splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        )
        chunks = cells[:1] + re.findall(r"\*\*([^*]+)\*\*", line)
        for chunk in chunks:
            found += re.findall(r"[\u4e00-\u9fff]{2,12}", chunk)
    return found


# --------------------------------------------------------------------------------------------------------------
# The API page (zero_offload.__all__ and the subpackages' __all__), from docstrings via inspect
# --------------------------------------------------------------------------------------------------------------


class _Annotation:
    """Shows a string annotation (``from __future__ import annotations``) without quotes."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"

    def unquote_ann(a):
        return _Annotation(a) if isinstance(a, str) else a

    params = [p.replace(annotation=unquote_ann(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=unquote_ann(sig.return_annotation)))


def _doc_block(obj, own: bool = False) -> str:
    """The docstring as preformatted text (``own``: not one inherited from a base class)."""
    doc = inspect.cleandoc(obj.__doc__) if own and obj.__doc__ else None if own else inspect.getdoc(obj)
    if not doc:
        return "<p><em>No docstring.</em></p>\n"
    return f'<pre class="zo-doc">{html.escape(doc)}</pre>\n'


def _defined_in(obj) -> str | None:
    try:
        path = Path(inspect.getsourcefile(obj)).resolve()
        return path.relative_to(ROOT).as_posix()
    except (TypeError, ValueError, OSError):
        return None


def api_markdown() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    pkg = importlib.import_module("zero_offload")
    modules = [pkg] + [
        importlib.import_module(f"zero_offload.{m.name}")
        for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name)
        if m.ispkg
    ]
    out = [
        "# API reference\n",
        "The public surface of `zero_offload`: the names in `zero_offload.__all__` and in each subpackage's "
        "`__all__`, with their signatures and docstrings (generated from the code when the site is built).\n",
    ]
    for mod in modules:
        names = list(getattr(mod, "__all__", []) or [])
        if not names:
            continue
        out.append(f"## `{mod.__name__}`\n")
        summary = (inspect.getdoc(mod) or "").split("\n\n")[0]
        if summary:
            out.append(f'<pre class="zo-doc">{html.escape(summary)}</pre>\n')
        for name in names:
            obj = getattr(mod, name, None)
            if obj is None:
                continue
            kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "data"
            out.append(f"### `{mod.__name__}.{name}`\n")
            where = _defined_in(obj) if kind != "data" else None
            src = source_page_for(where) if where else None
            sig = _signature(obj) if kind != "data" else f" = {html.escape(repr(obj))[:200]}"
            out.append(f'<pre class="zo-sig"><code>{kind} {html.escape(name + sig)}</code></pre>\n')
            if src:
                out.append(f"Defined in [`{where}`]({src}).\n")
            if kind != "data":
                out.append(_doc_block(obj))
            if inspect.isclass(obj):
                for mname, member in inspect.getmembers(obj):
                    if mname.startswith("_") or mname not in obj.__dict__:
                        continue
                    raw = obj.__dict__[mname]
                    if isinstance(raw, property):
                        out.append(f'<pre class="zo-sig"><code>property {html.escape(mname)}</code></pre>\n')
                        out.append(_doc_block(raw))
                    elif callable(member):
                        out.append(
                            f'<pre class="zo-sig"><code>{html.escape(name)}.{html.escape(mname)}'
                            f"{html.escape(_signature(member))}</code></pre>\n"
                        )
                        out.append(
                            _doc_block(
                                raw if not isinstance(raw, (staticmethod, classmethod)) else member, own=True
                            )
                        )
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------------------
# Source pages (generated files under source/)
# --------------------------------------------------------------------------------------------------------------

SOURCE_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
pre {{ font-size: 13px; line-height: 1.45; overflow-x: auto; }}
nav a {{ margin-right: 1em; }}
.linenos {{ color: #999; padding-right: 1em; }}
{css}
</style></head>
<body><nav><a href="{home}">course home</a><a href="{up}">up: {updir}</a></nav>
<h1><code>{title}</code></h1>
{body}
</body></html>
"""


def source_files() -> list[str]:
    rels = [t for t in SOURCE_TOP if (ROOT / t).is_file()]
    for top in SOURCE_ROOTS:
        for dirpath, dirnames, filenames in os.walk(ROOT / top):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_PARTS and not d.startswith("."))
            for fn in sorted(filenames):
                p = Path(dirpath) / fn
                if p.suffix in SKIP_SUFFIXES or fn.startswith(".") or p.stat().st_size > MAX_SOURCE_BYTES:
                    continue
                rels.append(p.relative_to(ROOT).as_posix())
    return rels


def render_source_pages(rels: list[str]) -> dict[str, str]:
    """{site path: html (or an image's bytes)} for every source file and every directory above one."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import TextLexer, get_lexer_for_filename
    from pygments.util import ClassNotFound

    fmt = HtmlFormatter(linenos="table", cssclass="src", anchorlinenos=True, lineanchors="L")
    css = fmt.get_style_defs(".src")
    pages: dict[str, str] = {}
    dirs: dict[str, set[str]] = {}
    for rel in rels:
        if Path(rel).suffix.lower() in IMAGE_SUFFIXES:
            text = None
        else:
            try:
                text = (ROOT / rel).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
        try:
            lexer = get_lexer_for_filename(rel, stripnl=False)
        except ClassNotFound:
            lexer = TextLexer(stripnl=False)
        site_path = f"source/{rel}.html"
        parent = posixpath.dirname(rel)
        extra = ""
        page = page_for(rel)
        if page:
            extra = (
                f'<p>Rendered on the site as <a href="{rel_link(site_path, as_url(page))}">this page</a>.</p>'
            )
        if text is None:
            pages[f"source/{rel}"] = (ROOT / rel).read_bytes()
            body = f'<p><img src="{html.escape(posixpath.basename(rel))}" alt="{html.escape(rel)}"></p>'
        else:
            body = highlight(text, lexer, fmt)
        pages[site_path] = SOURCE_PAGE.format(
            title=html.escape(rel),
            css=css,
            home=rel_link(site_path, "index.html"),
            up=rel_link(site_path, f"source/{parent}/index.html" if parent else "source/index.html"),
            updir=html.escape(parent or "repository"),
            body=extra + body,
        )
        parts = rel.split("/")
        for i in range(len(parts)):
            dirs.setdefault("/".join(parts[:i]), set()).add(parts[i] + ("/" if i < len(parts) - 1 else ""))
    for d, entries in dirs.items():
        site_path = f"source/{d}/index.html" if d else "source/index.html"
        items = []
        for e in sorted(entries, key=lambda e: (not e.endswith("/"), e)):
            href = f"{e}index.html" if e.endswith("/") else f"{e}.html"
            items.append(f'<li><a href="{html.escape(href)}">{html.escape(e)}</a></li>')
        parent = posixpath.dirname(d)
        pages[site_path] = SOURCE_PAGE.format(
            title=html.escape(d + "/" if d else "repository"),
            css="",
            home=rel_link(site_path, "index.html"),
            up=rel_link(site_path, f"source/{parent}/index.html" if parent else "source/index.html"),
            updir=html.escape(parent or "repository"),
            body="<ul>" + "\n".join(items) + "</ul>",
        )
    return pages


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


# --------------------------------------------------------------------------------------------------------------
# mkdocs hooks (this file is listed under `hooks:` in mkdocs.yml)
# --------------------------------------------------------------------------------------------------------------

_SITE_MAP: dict = {}


def _load_map(config) -> dict:
    path = Path(config["docs_dir"]).parent / MAP_NAME
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def on_config(config):
    global _SITE_MAP
    _SITE_MAP = _load_map(config)
    MATH_PROBLEMS.clear()
    for handler in logging.getLogger("mkdocs").handlers + logging.getLogger().handlers:
        handler.addFilter(_NoAltFilter())
    config.markdown_extensions.append(make_math_extension())
    try:
        import jieba

        jieba.setLogLevel(logging.WARNING)
        for term in _SITE_MAP.get("terms", BASE_TERMS):
            jieba.add_word(term, freq=200_000)
    except ImportError:
        log.warning("jieba is not installed: Chinese search will not segment words")
    return config


def on_files(files, config):
    from mkdocs.structure.files import File

    for site_path, content in render_source_pages(source_files()).items():
        files.append(File.generated(config, site_path, content=content))
    return files


_HEADING_RE = re.compile(r'<h([1-6]) id="([^"]*)">(.*?)</h\1>', re.S)


def _notebook_headings(html_text: str, page) -> str:
    """Give a notebook's headings GitHub-style ids (nbconvert drops Chinese from them) and rebuild its TOC."""
    from mkdocs.structure.toc import get_toc
    from pymdownx.slugs import slugify

    slug = slugify(case="lower")
    seen: dict[str, int] = {}
    tokens: list[dict] = []
    stack: list[dict] = []

    def repl(m: re.Match) -> str:
        level, inner = int(m.group(1)), m.group(3)
        inner = re.sub(r'<a class="anchor-link"[^>]*>.*?</a>', "", inner, flags=re.S)
        name = html.unescape(re.sub(r"<[^>]+>", "", inner)).strip()
        base = slug(name, "-") or "section"
        n = seen.get(base, 0)
        seen[base] = n + 1
        hid = base if n == 0 else f"{base}_{n}"
        token = {"level": level, "id": hid, "name": html.escape(name), "children": []}
        while stack and stack[-1]["level"] >= level:
            stack.pop()
        (stack[-1]["children"] if stack else tokens).append(token)
        stack.append(token)
        return f'<h{level} id="{hid}">{inner}<a class="anchor-link" href="#{hid}">¶</a></h{level}>'

    html_text = _HEADING_RE.sub(repl, html_text)
    page.toc = get_toc(tokens)
    return html_text


class _NoAltFilter(logging.Filter):
    """nbconvert warns for every stored plot (notebook outputs carry no alt text); the hook below labels them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Alternative text is missing" not in record.getMessage()


def on_page_content(html_text, page, config, files):
    if page.file.src_uri.endswith(".ipynb"):
        html_text = _notebook_headings(html_text, page)
        label = f"A plot stored in {html.escape(_SITE_MAP.get('sources', {}).get(page.file.src_uri, 'the notebook'))}"
        html_text = html_text.replace(
            'alt="No description has been provided for this image"', f'alt="{label}"'
        )
    src = _SITE_MAP.get("sources", {}).get(page.file.src_uri)
    if not src:
        return html_text
    target = source_page_for(src)
    if not target:
        return html_text
    href = posixpath.relpath(target, posixpath.dirname(page.file.url) or ".")
    link = f'<p class="zo-source">Source: <a href="{href}"><code>{html.escape(src)}</code></a></p>\n'
    return link + html_text


_SCRIPT_RE = re.compile(r"<script(?P<attrs>[^>]*)>(?P<body>.*?)</script>", re.S | re.I)


def _strip_cdn_script(m: re.Match) -> str:
    """mkdocs-jupyter's MathJax tag (empty or CDN src), its config, and its mermaid loader (imports a CDN)."""
    attrs, body = m.group("attrs"), m.group("body")
    src = re.search(r"\bsrc=\"([^\"]*)\"", attrs)
    if src and (not src.group(1) or re.match(r"https?://", src.group(1))):
        return ""
    if "text/x-mathjax-config" in attrs or re.search(r"import\(\s*[\"']https?://", body):
        return ""
    return m.group(0)


def on_post_page(output, page, config):
    return _SCRIPT_RE.sub(_strip_cdn_script, output)


def on_post_build(config):
    # The chapters' TeX is converted in this (hook) instance of the module: hand its problems to build().
    path = Path(config["docs_dir"]).parent / "math-problems.json"
    path.write_text(json.dumps(MATH_PROBLEMS, ensure_ascii=False, indent=1), encoding="utf-8")


# --------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------


def build(site_dir: Path, staging: Path, strict: bool = True) -> dict:
    """Stage the sources and build the site; returns the site map (with the build's report)."""
    from mkdocs.commands.build import build as mkdocs_build
    from mkdocs.config import load_config

    staging.mkdir(parents=True, exist_ok=True)
    docs = staging / "docs"
    site_map = stage(docs)
    (staging / MAP_NAME).write_text(json.dumps(site_map, ensure_ascii=False, indent=1), encoding="utf-8")
    cfg = load_config(
        str(ROOT / "mkdocs.yml"),
        docs_dir=str(docs),
        site_dir=str(site_dir),
        nav=site_map["nav"],
        strict=strict,
    )
    mkdocs_build(cfg)
    problems = staging / "math-problems.json"
    if problems.exists():
        site_map["math_problems"] += json.loads(problems.read_text(encoding="utf-8"))
    report = {k: site_map[k] for k in ("broken_links", "math_problems")}
    (staging / "report.json").write_text(json.dumps(report, ensure_ascii=False, indent=1), encoding="utf-8")
    return site_map


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site-dir", default=str(ROOT / "out" / "site"))
    ap.add_argument("--staging", default=str(ROOT / "out" / "site-src"))
    ap.add_argument("--no-strict", action="store_true", help="do not treat warnings as errors")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)-7s -  %(message)s")
    t0 = time.perf_counter()
    site_map = build(Path(args.site_dir), Path(args.staging), strict=not args.no_strict)
    for b in site_map["broken_links"]:
        shown = (
            "linked to the page, without the anchor"
            if b["text"] == "(anchor only)"
            else "shown as plain text"
        )
        print(f"unresolved link in {b['source']}: ({b['target']}): {shown}", file=sys.stderr)
    for p in site_map["math_problems"]:
        print(f"TeX that did not convert (shown as code): {p['tex']!r}: {p['error']}", file=sys.stderr)
    print(f"site built in {time.perf_counter() - t0:.1f} s: {args.site_dir}/index.html")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
