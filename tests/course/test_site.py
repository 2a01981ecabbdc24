"""The course website (`make site`): it builds strictly, every link resolves, nothing loads from the network,
every chapter, lesson and lab has a page, and Chinese search finds the glossary's terms.

The site is built once, into a temporary folder; no browser is needed (`make site-check` is the browser check).
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("mkdocs")
pytest.importorskip("material")
pytest.importorskip("mkdocs_jupyter")
pytest.importorskip("jieba")
pytest.importorskip("latex2mathml")

from tools import build_site  # noqa: E402
from tools.site.mathml import MATH_RE, math_html  # noqa: E402
from tools.site.paths import as_url  # noqa: E402

SEARCH_TERMS = ["梯度分片", "卸载", "流水线"]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    site_map = build_site.build(out / "site", out / "staging", strict=True)  # raises on any warning
    return out / "site", site_map


class _Links(HTMLParser):
    """Collects ids, and every URL with the tag and attribute that carries it."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.urls: list[tuple[str, str, str, dict]] = []  # (tag, attribute, url, attrs)
        self.inline_scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key) and (key == "id" or tag == "a"):
                self.ids.add(a[key])
        for key in ("href", "src"):
            if a.get(key) is not None:
                self.urls.append((tag, key, a[key], a))
        self._in_script = tag == "script" and "src" not in a

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.inline_scripts.append(data)


_parsed: dict[Path, _Links] = {}


def parse(path: Path) -> _Links:
    if path not in _parsed:
        p = _Links()
        p.feed(path.read_text(encoding="utf-8"))
        _parsed[path] = p
    return _parsed[path]


def pages(site_dir: Path) -> list[Path]:
    """The mkdocs pages (not the generated source listings)."""
    return [p for p in site_dir.rglob("*.html") if not p.relative_to(site_dir).parts[0] == "source"]


def test_site_builds_strictly_with_a_home_page(site):
    site_dir, site_map = site
    home = (site_dir / "index.html").read_text(encoding="utf-8")
    assert "Course map" in home
    # The README's course map, extracted at build time, links every chapter's page.
    for rel in site_map["chapters"]:
        if not rel.endswith("glossary.md"):
            assert as_url(rel) in home, rel


def test_every_chapter_lesson_and_lab_has_a_page(site):
    site_dir, _ = site
    chapters = sorted((ROOT / "course").glob("*.md"))
    assert len(chapters) >= 6
    for path in chapters:
        page = site_dir / "chapters" / f"{path.stem}.html"
        assert page.is_file(), path
        text = page.read_text(encoding="utf-8")
        assert f"course/{path.name}" in text  # its source link
        if path.stem[0].isdigit():
            assert "Abstract." in text, f"{path.name}: English abstract not rendered"
    for path in sorted((ROOT / "lessons").glob("*.ipynb")):
        page = site_dir / "lessons" / f"{path.stem}.html"
        assert page.is_file(), path
        stored = sum(
            "image/png" in out.get("data", {})
            for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]
            for out in cell.get("outputs", [])
        )
        assert page.read_text(encoding="utf-8").count('src="data:image/png') >= stored, path
    for path in sorted((ROOT / "labs").glob("lab*/README.md")):
        lab = path.parent.name
        page = site_dir / "labs" / f"{lab}.html"
        assert page.is_file(), path
        assert f"make {lab}" in page.read_text(encoding="utf-8")
    api = (site_dir / "api.html").read_text(encoding="utf-8")
    import zero_offload

    for name in zero_offload.__all__:
        assert f"zero_offload.{name}" in api


def test_the_answers_render_as_markdown_and_the_questions_keep_their_numbers(site):
    """Every <details> answer renders its Markdown (no raw backticks, no empty code block), also where it sits
    under a question's list item, and the question after it keeps its number."""
    site_dir, _ = site
    for page in sorted((site_dir / "chapters").glob("0*.html")):
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"<details.*?</details>", text, re.S):
            assert "`" not in re.sub(r"<code.*?</code>|<pre.*?</pre>", "", block, flags=re.S), page.name
        assert "<pre><span></span></pre>" not in text, page.name
        # A chapter in sections has one quiz a section: its numbers count up under each heading.
        for part in re.split(r"<h[23][ >]", text):
            starts = [int(n) for n in re.findall(r'<ol start="(\d+)"', part)]
            assert starts == sorted(starts) or not starts, (page.name, starts)


def test_navigation_has_previous_and_next_links(site):
    site_dir, site_map = site
    chapter = site_dir / as_url(site_map["chapters"][1])
    links = parse(chapter)
    rels = {a.get("rel") for tag, _, _, a in links.urls if tag == "a"}
    assert {"prev", "next"} <= rels or any(
        "md-footer__link--prev" in (a.get("class") or "") for *_, a in links.urls
    )


def test_every_internal_link_and_anchor_resolves(site):
    site_dir, site_map = site
    bad = []
    for page in sorted(site_dir.rglob("*.html")):
        if page.name == "404.html" and page.parent == site_dir:
            continue  # the server's error page: absolute paths by design
        for tag, attr, url, _ in parse(page).urls:
            parts = urlsplit(url)
            if parts.scheme or url.startswith("//") or not url:
                continue
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if parts.path.endswith("/") or target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                bad.append(f"{page.relative_to(site_dir)}: {tag}[{attr}]={url} (no such file)")
                continue
            if (
                parts.fragment
                and target.suffix == ".html"
                and unquote(parts.fragment) not in parse(target).ids
            ):
                bad.append(f"{page.relative_to(site_dir)}: {url} (no such anchor)")
    assert not bad, "\n".join(bad[:40])
    if site_map["broken_links"]:  # shown as plain text on the site; reported, not an error
        print("links in the sources that do not resolve:", site_map["broken_links"])


def test_no_page_loads_an_asset_from_another_host(site):
    site_dir, _ = site
    external = re.compile(r"^(https?:)?//", re.I)
    bad = []
    for page in sorted(pages(site_dir)):
        links = parse(page)
        for tag, attr, url, a in links.urls:
            is_asset = tag in ("script", "img", "iframe", "source", "audio", "video", "embed") or (
                tag == "link" and a.get("rel") not in ("canonical", "alternate")
            )
            if is_asset and external.match(url.strip()):
                bad.append(f"{page.relative_to(site_dir)}: <{tag} {attr}={url}>")
        for script in links.inline_scripts:
            if re.search(r"""import\(\s*["']https?://|\.src\s*=\s*["']https?://""", script):
                bad.append(f"{page.relative_to(site_dir)}: an inline script loads from another host")
        html = page.read_text(encoding="utf-8")
        if re.search(r"url\(\s*['\"]?(https?:)?//", html) or "fonts.googleapis" in html:
            bad.append(f"{page.relative_to(site_dir)}: a style loads from another host")
    for css in site_dir.rglob("*.css"):
        if re.search(
            r"@import\s+url\(\s*['\"]?https?:|url\(\s*['\"]?https?://", css.read_text(encoding="utf-8")
        ):
            bad.append(f"{css.relative_to(site_dir)}: loads from another host")
    assert not bad, "\n".join(bad[:40])


def _search(index: dict, query: str) -> set[str]:
    """The pages Material's search returns for ``query``: the query split on the index's separator, each term
    matched as a prefix (Material adds a trailing wildcard) of a title or text token."""
    sep = re.compile(index["config"]["separator"])
    terms = [t.lower() for t in sep.split(query) if t]
    hits = set()
    for doc in index["docs"]:
        tokens = {
            t.lower() for field in ("title", "text") for t in sep.split(re.sub(r"<[^>]+>", " ", doc[field]))
        }
        if all(any(tok.startswith(term) for tok in tokens) for term in terms):
            hits.add(doc["location"].split("#")[0])
    return hits


@pytest.mark.parametrize("term", SEARCH_TERMS)
def test_chinese_search_finds_the_chapter_of_a_glossary_term(site, term):
    site_dir, site_map = site
    index = json.loads((site_dir / "search" / "search_index.json").read_text(encoding="utf-8"))
    counts = {}
    for rel in site_map["chapters"]:
        n = (ROOT / "course" / Path(rel).name).read_text(encoding="utf-8").count(term)
        if n:
            counts[as_url(rel)] = n
    assert counts, f"no chapter mentions {term}"
    hits = _search(index, term)
    most = max(counts, key=counts.get)
    assert most in hits, f"searching {term} misses {most} (hits: {sorted(hits)})"
    assert len(hits & set(counts)) >= (len(counts) + 1) // 2, (sorted(hits), counts)
    glossary = ROOT / "course" / "glossary.md"
    if glossary.exists() and term in glossary.read_text(encoding="utf-8"):
        assert "chapters/glossary.html" in hits


def test_math_becomes_mathml_at_build_time():
    html = math_html(MATH_RE.search(r"$(2 + 2 + K)\Psi = 16\Psi$"))
    assert "<math" in html and 'display="inline"' in html
    html = math_html(MATH_RE.search("$$\n\\frac{m}{\\sqrt{v}+\\epsilon}\n$$"))
    assert "<mfrac>" in html and 'display="block"' in html
    assert MATH_RE.search("prices $5 and $6, `$CC`") is None
