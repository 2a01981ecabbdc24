"""TeX -> MathML at build time, so that browsers render the math natively (no MathJax or KaTeX, no CDN).

``$...$``, ``\\(...\\)`` (inline) and ``$$...$$``, ``\\[...\\]`` (display) become MathML through
``latex2mathml``. TeX it cannot convert stays visible as code and is listed in the build's report.
"""

from __future__ import annotations

import html
import re

# A single $ opens or closes inline math only with no space on its inner side and no letter or digit on its outer
# side, so that prices in prose ("$5 and $6") stay text.
MATH_RE = re.compile(
    r"(?<![\\$])\$\$(?P<d1>.+?)\$\$"
    r"|\\\[(?P<d2>.+?)\\\]"
    r"|\\\((?P<i2>.+?)\\\)"
    r"|(?<![\\$A-Za-z0-9])\$(?![\s$])(?P<i1>[^$\n]+?)(?<![\s\\])\$(?![$0-9A-Za-z])",
    re.S,
)
MATH_PROBLEMS: list[dict] = []  # TeX that did not convert, for the build's report (cleared per build)


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
