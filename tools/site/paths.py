"""Where each repository file appears on the site: its page, its highlighted source page, and the relative
links between staged docs paths (``out/site-src/docs/``) and built URLs (``out/site/``)."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # tools/site/paths.py -> the repository root
MAP_NAME = "site-map.json"  # written next to the staged docs (not inside them)

# Files under these roots get a highlighted source page under source/ (plus the listed top-level files).
SOURCE_ROOTS = ["course", "labs", "lessons", "solutions", "src", "tools", "tests", "examples"]
SOURCE_TOP = ["README.md", "Makefile", "pyproject.toml", "mkdocs.yml"]
SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".hypothesis", ".ruff_cache"}
SKIP_SUFFIXES = {".pyc", ".so", ".o", ".pt", ".bin", ".ipynb", ".pdf", ".npz", ".npy"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"}  # shown as images on their source page
MAX_SOURCE_BYTES = 400_000


def chapter_files() -> list[Path]:
    """course/*.md in chapter order (00-, 01-, ..., 03-, 03a-, ...), each module's appendix
    (``04-tuning-appendix.md``) after its chapters, the glossary last."""
    files = sorted(
        (p for p in (ROOT / "course").glob("*.md") if re.match(r"\d", p.name)),
        key=lambda p: (module_of(p.name), is_appendix(p.name), p.name),
    )
    glossary = ROOT / "course" / "glossary.md"
    return files + ([glossary] if glossary.exists() else [])


def is_appendix(name: str) -> bool:
    """A chapter's appendix (``04-tuning-appendix.md``): the measurement detours its main line links to."""
    return name.endswith("-appendix.md")


def module_of(name: str) -> int | None:
    """The module number a file or lab name starts with (``03a-reading-deepspeed.md`` -> 3), or None."""
    m = re.match(r"(\d+)", name)
    return int(m.group(1)) if m else None


def page_for(rel: str) -> str | None:
    """The staged docs path of the site page that renders repository path ``rel`` (or None)."""
    rel = rel.rstrip("/")
    p = ROOT / rel
    if rel == "README.md":
        return "readme.md"  # the home page (index.md) is the course's front door, in Chinese
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
