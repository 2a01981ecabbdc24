"""The mkdocs hooks (``hooks:`` in mkdocs.yml names ``tools/build_site.py``, which imports these).

They add the math extension and jieba's extra words, add the source pages under ``source/`` as generated files,
put a "source" link on every page, give the notebooks' headings ids that match the chapters' links, label their
stored plots, and strip the CDN script tags mkdocs-jupyter emits by itself (its MathJax and mermaid loaders,
both unused here).
"""

from __future__ import annotations

import html
import json
import logging
import posixpath
import re
from pathlib import Path

from .mathml import MATH_PROBLEMS, make_math_extension
from .paths import MAP_NAME, source_page_for
from .search import BASE_TERMS, add_terms_to_jieba
from .source_pages import render_source_pages, source_files

_SITE_MAP: dict = {}  # the staging's site map (site-map.json), read again at every build


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
    add_terms_to_jieba(_SITE_MAP.get("terms", BASE_TERMS))
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
