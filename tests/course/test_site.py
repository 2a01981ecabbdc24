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
from tools.site.pages import first_heading, navigation, time_estimate  # noqa: E402
from tools.site.paths import as_url, chapter_files, is_appendix, module_of  # noqa: E402
from tools.site.sections import questions, quiz_block, sections  # noqa: E402

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
    """The home page is the course's front door in Chinese: the path through every chapter, lesson and lab, each
    chapter's 预计用时 as the chapter states it, what to install, and links to the README and the API."""
    site_dir, site_map = site
    home = (site_dir / "index.html").read_text(encoding="utf-8")
    for words in (
        "学习路线",
        "准备环境",
        "make test",
        "make demo",
        "make jupyter",
        "Python 3.10",
        "不需要 GPU",
    ):
        assert words in re.sub(r"<[^>]+>", "", home), words
    assert 'href="readme.html"' in home and 'href="api.html"' in home
    for rel in site_map["chapters"] + site_map["lessons"] + site_map["labs"]:
        assert f'href="{as_url(rel)}"' in home, rel
    for path in chapter_files():
        when = time_estimate(path.read_text(encoding="utf-8"))
        if path.name[0].isdigit() and not is_appendix(path.name):
            assert when, f"{path.name}: no **预计用时**： line"
        if when:
            assert re.sub(r"[`*\[\]]|\(.*?\)", "", when)[:12] in re.sub(r"<[^>]+>", "", home), path.name
    # The README (the engine's story, in English) is a page of its own, with its course map.
    readme = (site_dir / "readme.html").read_text(encoding="utf-8")
    assert "Course map" in readme and "README.md" in readme


def test_a_time_estimate_is_read_with_its_continuation_lines():
    text = "# x\n\n**预计用时**：阅读约 1.5 小时；笔记本\n边读边改约 1 小时；read the\nlab.\n\n正文\n"
    assert time_estimate(text) == "阅读约 1.5 小时；笔记本边读边改约 1 小时；read the lab."
    assert time_estimate("# x\n\n正文\n") is None
    text = "**预计用时**：3～4 小时（一边读，一边 `grep`。）。本章的链接形如 [stage3.py#L1905][]。\n"
    assert time_estimate(text) == "3～4 小时（一边读，一边 `grep`。）。"
    assert time_estimate("**预计用时**：见 [a.py#L1][] 和 [b][x]\n") == "见 a.py#L1 和 b"


def test_appendices_sit_at_the_end_of_their_module_under_their_title(tmp_path):
    """An appendix (``NN-name-appendix.md``) is listed under its module, after the module's lesson and lab, with
    its first heading as its title (marked as an appendix where the heading does not say so)."""
    course = tmp_path / "course"
    course.mkdir()
    files = {
        "04-tuning.md": "# 第 4 章 调优篇\n",
        "04a-simd-primer.md": "# 第 4 章（入门）SIMD\n",
        "04-tuning-appendix.md": "# 测量的细节\n\n> **Abstract.** Detours.\n",
        "05-practice.md": "# 第 5 章 实战篇\n",
    }
    for name, text in files.items():
        (course / name).write_text(text, encoding="utf-8")
    order = sorted(course.glob("*.md"), key=lambda p: (module_of(p.name), is_appendix(p.name), p.name))
    chapters = [(p, f"chapters/{p.name}", first_heading(p.read_text(encoding="utf-8"))) for p in order]
    lessons = [(tmp_path / "lessons/04_tuning.ipynb", "lessons/04_tuning.ipynb", "第 4 课")]
    labs = [(tmp_path / "labs/lab4/README.md", "labs/lab4.md", "Lab 4")]
    nav = navigation(chapters, lessons, labs, "| 4 tuning 调优篇 | x |\n| 5 practice 实战篇 | y |")
    module4 = next(v for item in nav for k, v in item.items() if k.startswith("Module 4"))
    assert module4 == [
        {"第 4 章 调优篇": "chapters/04-tuning.md"},
        {"第 4 章（入门）SIMD": "chapters/04a-simd-primer.md"},
        {"Lesson 4: 第 4 课": "lessons/04_tuning.ipynb"},
        {"Lab 4": "labs/lab4.md"},
        {"附录 · 测量的细节": "chapters/04-tuning-appendix.md"},
    ]
    assert [k for item in nav for k in item][-2:] == ["README (English)", "API"]


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
    under a question's list item, and the question after it keeps its number (within its section)."""
    site_dir, _ = site
    for page in sorted((site_dir / "chapters").glob("0*.html")):
        text = page.read_text(encoding="utf-8")
        for block in re.findall(r"<details.*?</details>", text, re.S):
            assert "`" not in re.sub(r"<code.*?</code>|<pre.*?</pre>", "", block, flags=re.S), page.name
        assert "<pre><span></span></pre>" not in text, page.name
        for part in text.split("<h2")[1:]:  # each section's quiz numbers its questions from 1
            starts = [int(n) for n in re.findall(r'<ol start="(\d+)"', part)]
            assert starts == sorted(starts), (page.name, part[:80], starts)


def test_each_checkable_quiz_question_is_answerable_in_its_page(site):
    """Every question a chapter marks as checkable is a quiz block on its page, with the parser's answer (the
    block's details are tests/course/test_site_quiz.py's); there are as many blocks as marks."""
    site_dir, site_map = site
    for rel in site_map["chapters"]:
        source = (ROOT / "course" / Path(rel).name).read_text(encoding="utf-8")
        asked = [
            q
            for s in sections(source)
            if quiz_block(s) is not None
            for q in _questions_or_none(quiz_block(s))
            if q.kind != "open"
        ]
        html = (site_dir / as_url(rel)).read_text(encoding="utf-8")
        blocks = re.findall(r'<div class="zo-quiz" ([^>]*)>', html)
        assert len(blocks) == len(asked), rel
        for attrs, q in zip(blocks, asked, strict=True):
            assert f'data-quiz="{q.kind}"' in attrs and f'data-answer="{q.answer}"' in attrs, (rel, q)
    if any(
        'class="zo-quiz"' in p.read_text(encoding="utf-8") for p in (site_dir / "chapters").glob("*.html")
    ):
        assert (site_dir / "assets" / "quiz.js").is_file()


def _questions_or_none(quiz: str) -> list:
    try:
        return questions(quiz)
    except ValueError:  # a mark the parser refuses is shown as written (test_sections.py names it)
        return []


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
