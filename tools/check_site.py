"""Check the built course website in a real browser: ``make site-check`` (after ``make site``).

Serves ``out/site/`` on 127.0.0.1, opens it in Debian's Chromium through Playwright (``executable_path``; no
``playwright install``), blocks every request to another host (and fails if a page makes one), and checks:

- the home page: Chinese glyphs render (two different CJK characters draw different pixels, and neither draws
  like a character no font has: no tofu);
- a chapter with math and a figure: every ``<math>`` element has a non-zero size and fractions are laid out
  (numerator above denominator), every image has ``naturalWidth > 0``;
- a lesson with plots: every stored plot loads;
- search: typing a Chinese term in the search box lists its chapter;
- quizzes: on the first pages with a choice and a number question, a wrong answer says so (不对) and leaves the
  explanation closed, the right one says so (正确) and opens it; the page's number rule agrees with
  ``Question.accepts`` on a few inputs. With no quiz on any page this check fails and says so.

Screenshots and a JSON report go to ``out/site-check/``. Exit status 1 if a check fails, 2 if something needed
is missing (the message says what and how to install it).

    python -m tools.check_site [--site out/site] [--out out/site-check] [--term 梯度分片]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from urllib.parse import urlsplit

# The package is tools.site: a bare "site" would be Python's own module.
from tools.site.browser import Missing, check_cjk_font, find_chromium, keep_requests_local, serve
from tools.site.sections import Question

ROOT = Path(__file__).resolve().parent.parent


def pick_chapter(site: Path) -> tuple[str, bool, bool]:
    """The chapter page with the most math and images: (path, has_math, has_figure)."""
    best = None
    for page in sorted((site / "chapters").glob("*.html")):
        text = page.read_text(encoding="utf-8")
        article = text.split("<article", 1)[-1]
        n_math = article.count("<math")
        n_img = len(re.findall(r"<img\b", article))
        score = (n_math > 0) + (n_img > 0), n_math + n_img
        if best is None or score > best[0]:
            best = (score, page.relative_to(site).as_posix(), n_math > 0, n_img > 0)
    if best is None:
        raise Missing(f"no chapter pages under {site}/chapters: run `make site` first")
    return best[1], best[2], best[3]


def pick_lesson(site: Path) -> str:
    pages = sorted((site / "lessons").glob("*.html"))
    if not pages:
        raise Missing(f"no lesson pages under {site}/lessons: run `make site` first")
    return (
        max(pages, key=lambda p: p.read_text(encoding="utf-8").count("data:image/png"))
        .relative_to(site)
        .as_posix()
    )


def pick_quizzes(site: Path) -> dict[str, str]:
    """The first chapter page with a choice question, and the first with a number question: kind -> path."""
    found: dict[str, str] = {}
    for page in sorted((site / "chapters").glob("*.html")):
        for kind in re.findall(
            r'<div class="zo-quiz"[^>]*data-quiz="(\w+)"', page.read_text(encoding="utf-8")
        ):
            found.setdefault(kind, page.relative_to(site).as_posix())
    return found


# JavaScript run in the page -----------------------------------------------------------------------------------

JS_IMAGES = """async () => {
  const imgs = [...document.querySelectorAll('article img, .md-content img')];
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
  return imgs.map(i => ({src: i.currentSrc.slice(0, 60), w: i.naturalWidth, h: i.naturalHeight}));
}"""

JS_MATH = """() => [...document.querySelectorAll('article math')].map(m => {
  const r = m.getBoundingClientRect();
  const frac = m.querySelector('mfrac');
  let stacked = null;
  if (frac && frac.children.length == 2) {
    const a = frac.children[0].getBoundingClientRect(), b = frac.children[1].getBoundingClientRect();
    stacked = a.bottom <= b.top + 1;
  }
  return {w: r.width, h: r.height, display: m.getAttribute('display'), stacked,
          visible: !!(m.offsetParent || m.getClientRects().length)};
})"""

# Draw a string on a canvas with the page's font and return a hash of its pixels.
JS_GLYPHS = """(chars) => {
  const font = getComputedStyle(document.querySelector('.md-typeset') || document.body).fontFamily;
  const draw = (s) => {
    const c = document.createElement('canvas'); c.width = 64; c.height = 64;
    const x = c.getContext('2d'); x.fillStyle = '#fff'; x.fillRect(0, 0, 64, 64);
    x.fillStyle = '#000'; x.font = `48px ${font}`; x.textBaseline = 'top'; x.fillText(s, 4, 4);
    const d = x.getImageData(0, 0, 64, 64).data; let h = 0, ink = 0;
    for (let i = 0; i < d.length; i += 4) { h = (h * 31 + d[i]) >>> 0; if (d[i] < 128) ink++; }
    return {hash: h, ink, width: x.measureText(s).width};
  };
  return {font, glyphs: chars.map(draw)};
}"""


class Checks:
    """The results: each check printed as it is made, then all of them saved as report.json."""

    def __init__(self, out: Path, chromium: str, font: str):
        self.out = out
        self.results: dict = {"chromium": chromium, "cjk_font": font, "checks": [], "screenshots": {}}

    def check(self, name: str, ok: bool, detail) -> None:
        self.results["checks"].append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")

    def screenshot(self, page, name: str, what: str) -> None:
        page.screenshot(path=str(self.out / name))
        self.results["screenshots"][name] = what

    def screenshot_of(self, element, name: str, what: str) -> None:
        element.screenshot(path=str(self.out / name))
        self.results["screenshots"][name] = what


def check_home(page, base: str, checks: Checks) -> None:
    """Chinese glyphs: two CJK characters draw differently, and neither like a character no font has (tofu)."""
    page.goto(base + "index.html", wait_until="networkidle")
    glyphs = page.evaluate(JS_GLYPHS, ["梯", "载", "\U000f0000"])
    a, b, missing = glyphs["glyphs"]
    checks.check(
        "CJK glyphs render (no tofu)",
        a["ink"] > 0
        and a["hash"] != b["hash"]
        and a["hash"] != missing["hash"]
        and b["hash"] != missing["hash"],
        {"font-family": glyphs["font"], "梯": a, "载": b, "U+F0000 (no glyph)": missing},
    )
    checks.screenshot(page, "home.png", "home page: the course's front door in Chinese, navigation")


def check_chapter(page, base: str, site: Path, checks: Checks) -> None:
    """A chapter with math and a figure: the math is laid out and every image loads."""
    chapter, has_math, has_fig = pick_chapter(site)
    if not (has_math and has_fig):
        raise Missing(f"no chapter has both math and a figure (best: {chapter}); the check needs one")
    page.goto(base + chapter, wait_until="networkidle")
    maths = [m for m in page.evaluate(JS_MATH) if m["visible"]]
    checks.check(
        "math is typeset (MathML, non-zero size, fractions stacked)",
        bool(maths)
        and all(m["w"] > 0 and m["h"] > 0 for m in maths)
        and all(m["stacked"] is not False for m in maths),
        {"page": chapter, "math elements": len(maths), "first": maths[:3]},
    )
    imgs = page.evaluate(JS_IMAGES)
    checks.check(
        "chapter figures load",
        bool(imgs) and all(i["w"] > 0 for i in imgs),
        {"page": chapter, "images": imgs[:10]},
    )
    target = page.locator("article math").first
    if target.count():
        target.scroll_into_view_if_needed()
    checks.screenshot(page, "chapter.png", f"{chapter}: the chapter at its first formula")
    if has_fig:
        page.locator("article img").first.scroll_into_view_if_needed()
        checks.screenshot(page, "chapter-figure.png", f"{chapter}: its first figure")


def check_lesson(page, base: str, site: Path, checks: Checks) -> None:
    """A lesson with plots: every stored plot (a data: URL in the notebook's outputs) loads."""
    lesson = pick_lesson(site)
    page.goto(base + lesson, wait_until="networkidle")
    imgs = page.evaluate(JS_IMAGES)
    plots = [i for i in imgs if i["src"].startswith("data:image/png")]
    checks.check(
        "lesson plots load",
        bool(plots) and all(i["w"] > 0 for i in plots),
        {"page": lesson, "plots": plots},
    )
    page.locator("img[src^='data:image/png']").first.scroll_into_view_if_needed()
    checks.screenshot(page, "lesson.png", f"{lesson}: the first stored plot")


def check_search(page, base: str, site: Path, term: str, checks: Checks) -> None:
    """Typing a Chinese term in the search box lists a chapter that has it."""
    page.goto(base + "index.html", wait_until="networkidle")
    box = page.locator("input.md-search__input")
    box.click()
    box.type(term, delay=30)
    box.press("End")  # Material reads the query on keyup; typed CJK text arrives as input events only
    try:
        page.wait_for_selector(".md-search-result__item", timeout=15_000)
    except Exception:
        pass  # no result list: the check below fails and says so
    page.wait_for_timeout(500)
    hits = page.eval_on_selector_all(
        ".md-search-result__item > a", "as => as.map(a => a.getAttribute('href'))"
    )
    chapters = sorted(
        {urlsplit(h).path.lstrip("/") for h in hits if "/chapters/" in h}
        & {
            p.relative_to(site).as_posix()
            for p in (site / "chapters").glob("*.html")
            if term in p.read_text(encoding="utf-8")
        }
    )
    meta = (
        page.locator(".md-search-result__meta").first.inner_text()
        if page.locator(".md-search-result__meta").count()
        else ""
    )
    checks.check(
        f"search finds {term} in a chapter that has it",
        bool(chapters),
        {"results": len(hits), "chapters": chapters, "meta": meta},
    )
    checks.screenshot(page, "search.png", f"search for {term}: the result list")


JS_QUIZ_STATE = """(quiz) => ({
  result: quiz.querySelector('.zo-quiz-result').textContent,
  open: !!(quiz.querySelector('details') || {}).open,
  state: quiz.getAttribute('data-state'),
})"""


def _question(quiz) -> Question:
    """The Question a quiz block in the page stands for (from its data attributes)."""
    kind, answer = quiz.get_attribute("data-quiz"), quiz.get_attribute("data-answer")
    if kind == "choice":
        letters = quiz.locator("input[type=radio]").evaluate_all("rs => rs.map(r => r.value)")
        return Question(0, "", kind, answer, options=tuple((x, x) for x in letters))
    return Question(
        0,
        "",
        kind,
        answer,
        tolerance=float(quiz.get_attribute("data-tolerance")),
        relative=quiz.get_attribute("data-relative") == "1",
    )


def _answer(quiz, q: Question, given: str) -> dict:
    if q.kind == "choice":
        quiz.locator(f"input[type=radio][value='{given}']").check()
    else:
        quiz.locator(".zo-quiz-number").fill(given)
    quiz.locator(".zo-quiz-check").click()
    return quiz.evaluate(JS_QUIZ_STATE)


def check_quizzes(page, base: str, site: Path, checks: Checks) -> None:
    """A choice and a number question: a wrong answer first (says 不对, the explanation stays closed), then the
    right one (says 正确, the explanation opens); screenshots of each."""
    found = pick_quizzes(site)
    if not found:
        checks.check(
            "a page has a quiz",
            False,
            "no chapter page has a quiz block: no question in a ### 小测 carries a <!-- quiz: choice X --> or "
            "<!-- quiz: number V ±T --> mark (tools/site/sections.py), or the staging did not turn it into one",
        )
        return
    for kind in ("choice", "number"):
        if kind not in found:
            checks.check(f"a {kind} quiz question", False, f"no chapter page has a {kind} question")
            continue
        page.goto(base + found[kind], wait_until="networkidle")
        quiz = page.locator(f".zo-quiz[data-quiz={kind}]").first
        quiz.scroll_into_view_if_needed()
        q = _question(quiz)
        if kind == "choice":
            wrong = next(letter for letter, _ in q.options if letter != q.answer)
            right = q.answer
        else:
            target = float(q.answer)
            allowed = q.tolerance * abs(target) if q.relative else q.tolerance
            wrong, right = f"{target + 2 * allowed + 1:g}", q.answer
        before = quiz.evaluate(JS_QUIZ_STATE)
        said_wrong = _answer(quiz, q, wrong)
        checks.screenshot_of(
            quiz, f"quiz-{kind}-wrong.png", f"{found[kind]}: a wrong answer ({wrong}) to a {kind} question"
        )
        said_right = _answer(quiz, q, right)
        checks.screenshot_of(
            quiz, f"quiz-{kind}-right.png", f"{found[kind]}: the right answer ({right}), explanation open"
        )
        checks.check(
            f"a {kind} question says wrong, then right and opens its explanation",
            not before["open"]
            and "不对" in said_wrong["result"]
            and not said_wrong["open"]
            and "正确" in said_right["result"]
            and said_right["open"],
            {
                "page": found[kind],
                "answer": q.answer,
                "wrong": [wrong, said_wrong],
                "right": [right, said_right],
            },
        )
        if kind == "number":
            tries = [right, wrong, f"{target + allowed:g}", f"{target - allowed * 1.01 - 1e-9:.12g}", "x", ""]
            data = {
                "quiz": kind,
                "answer": q.answer,
                "tolerance": repr(q.tolerance),
                "relative": "1" if q.relative else "0",
            }
            page_says = page.evaluate(
                "([d, vs]) => vs.map(v => window.zoQuizAccepts(d, v) === true)", [data, tries]
            )
            checks.check(
                "the page checks numbers as Question.accepts does",
                page_says == [q.accepts(v) for v in tries],
                {"inputs": tries, "page": page_says, "Question.accepts": [q.accepts(v) for v in tries]},
            )


def run(site: Path, out: Path, term: str) -> dict:
    from playwright.sync_api import sync_playwright

    chromium = find_chromium()
    font = check_cjk_font()
    out.mkdir(parents=True, exist_ok=True)
    checks = Checks(out, chromium, font)
    server, base = serve(site)
    external: list[str] = []
    try:
        with sync_playwright() as pw:
            try:
                browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            except Exception as exc:
                raise Missing(f"Chromium at {chromium} did not start under Playwright: {exc}") from exc
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            keep_requests_local(page, external)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))

            check_home(page, base, checks)
            check_chapter(page, base, site, checks)
            check_lesson(page, base, site, checks)
            check_search(page, base, site, term, checks)
            check_quizzes(page, base, site, checks)
            checks.check("no request left the machine", not external, external[:10])
            checks.check("no script errors", not errors, errors[:5])
            browser.close()
    finally:
        server.shutdown()
    results = checks.results
    results["ok"] = all(c["ok"] for c in results["checks"])
    (out / "report.json").write_text(json.dumps(results, ensure_ascii=False, indent=1), encoding="utf-8")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site", default=str(ROOT / "out" / "site"))
    ap.add_argument("--out", default=str(ROOT / "out" / "site-check"))
    ap.add_argument("--term", default="梯度分片", help="the Chinese term to search for")
    args = ap.parse_args(argv)
    site = Path(args.site)
    try:
        if not (site / "index.html").is_file():
            raise Missing(f"{site}/index.html does not exist: run `make site` first")
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError as exc:
            raise Missing("Playwright is not installed: run `.venv/bin/pip install -e '.[dev]'`") from exc
        results = run(site, Path(args.out), args.term)
    except Missing as exc:
        print(f"site-check cannot run: {exc}", file=sys.stderr)
        return 2
    print(f"screenshots and report.json in {args.out}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
