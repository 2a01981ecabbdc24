"""The source pages under ``source/``: every repository file highlighted (images shown), and a listing for
every directory, so that each page's "source" link and each backticked path in the chapters works offline."""

from __future__ import annotations

import html
import os
import posixpath
from pathlib import Path

from .paths import (
    IMAGE_SUFFIXES,
    MAX_SOURCE_BYTES,
    ROOT,
    SKIP_PARTS,
    SKIP_SUFFIXES,
    SOURCE_ROOTS,
    SOURCE_TOP,
    as_url,
    page_for,
    rel_link,
)

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
