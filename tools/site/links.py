"""Rewriting the links in the staged copies of the sources, so that each one points at a page of the site.

A link to a chapter, lesson or lab goes to its page; a link to any other repository file goes to its source
page; an image is copied into the docs tree. Links that resolve nowhere are shown as plain text and recorded in
the build's report; anchors are checked against the headings the linked page will have.
"""

from __future__ import annotations

import functools
import html
import json
import posixpath
import re
import shutil
from pathlib import Path
from urllib.parse import unquote

from .paths import ROOT, as_url, page_for, rel_link, source_page_for, target_for

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
