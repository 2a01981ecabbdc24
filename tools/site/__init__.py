"""The course-website builder behind ``tools/build_site.py`` (``make site``), one concern per module.

- ``paths``: where each repository file appears on the site (its page, its source page) and relative links;
- ``links``: rewriting the staged copies' links to the site's pages, and the heading ids they may point at;
- ``mathml``: the Markdown extension that turns TeX into MathML at build time;
- ``search``: the words jieba keeps whole, so that Chinese search finds the course's terms;
- ``sections``: a chapter's sections of one sitting, their takeaways and quizzes (the format the tests check);
- ``quiz``: the quizzes' checkable questions made answerable in the page (with ``assets/quiz.js``, ``quiz.css``);
- ``pages``: the chapter, lesson, lab, README and home pages (``home.zh.md``), and the navigation;
- ``api``: the API page, from the docstrings;
- ``source_pages``: the highlighted repository files under ``source/``;
- ``staging``: the staged docs tree mkdocs builds from (``out/site-src/docs/``);
- ``hooks``: what mkdocs calls while it builds;
- ``browser``: Chromium, a Chinese font and a local server for ``tools/check_site.py`` (``make site-check``).

Import it as ``tools.site`` (with the repository root on ``sys.path``): a bare ``site`` is Python's own module.
"""
