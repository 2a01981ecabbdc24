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
the navigation (module -> chapter -> lesson -> lab -> appendix), generates the home page (in Chinese, from
``tools/site/home.zh.md`` and the chapters' time estimates), the README's page and the API page, turns the
chapters' checkable quiz questions into questions answered in the page (``tools/site/quiz.py``), then runs
``mkdocs build --strict`` through mkdocs' Python API. The same file is the mkdocs hook module (``hooks:`` in
``mkdocs.yml``): it adds the math extension, adds source pages under ``source/`` (the repository's files,
highlighted, so that every page's "source" link and every backticked path in the chapters works offline), puts a
source link on every page, and strips CDN script tags. The work itself is done by the
package ``tools/site/`` (one module per concern, listed in its ``__init__.py``); this file is its entry point.

    python -m tools.build_site [--site-dir out/site] [--staging out/site-src]    (from the repository root)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

# mkdocs loads this file as its hook module, by its path, and calls these by name (``hooks:`` in mkdocs.yml).
# The imports are absolute, so that they work there too; the package is ``tools.site``, as a bare ``site``
# would be Python's own module.
from tools.site.hooks import on_config, on_files, on_page_content, on_post_page  # noqa: F401
from tools.site.mathml import MATH_PROBLEMS
from tools.site.paths import MAP_NAME
from tools.site.staging import stage

ROOT = Path(__file__).resolve().parent.parent


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
    # The chapters' TeX is converted while mkdocs builds (the hooks share this process's MATH_PROBLEMS).
    site_map["math_problems"] += MATH_PROBLEMS
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
