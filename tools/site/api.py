"""The API page: the names in ``zero_offload.__all__`` and in each subpackage's ``__all__``, with their
signatures and docstrings, read from the code through ``inspect`` when the site is built."""

from __future__ import annotations

import html
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

from .paths import ROOT, source_page_for


class _Annotation:
    """Shows a string annotation (``from __future__ import annotations``) without quotes."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"

    def unquote_ann(a):
        return _Annotation(a) if isinstance(a, str) else a

    params = [p.replace(annotation=unquote_ann(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=unquote_ann(sig.return_annotation)))


def _doc_block(obj, own: bool = False) -> str:
    """The docstring as preformatted text (``own``: not one inherited from a base class)."""
    doc = inspect.cleandoc(obj.__doc__) if own and obj.__doc__ else None if own else inspect.getdoc(obj)
    if not doc:
        return "<p><em>No docstring.</em></p>\n"
    return f'<pre class="zo-doc">{html.escape(doc)}</pre>\n'


def _defined_in(obj) -> str | None:
    try:
        path = Path(inspect.getsourcefile(obj)).resolve()
        return path.relative_to(ROOT).as_posix()
    except (TypeError, ValueError, OSError):
        return None


def api_markdown() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    pkg = importlib.import_module("zero_offload")
    modules = [pkg] + [
        importlib.import_module(f"zero_offload.{m.name}")
        for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name)
        if m.ispkg
    ]
    out = [
        "# API reference\n",
        "The public surface of `zero_offload`: the names in `zero_offload.__all__` and in each subpackage's "
        "`__all__`, with their signatures and docstrings (generated from the code when the site is built).\n",
    ]
    for mod in modules:
        names = list(getattr(mod, "__all__", []) or [])
        if not names:
            continue
        out.append(f"## `{mod.__name__}`\n")
        summary = (inspect.getdoc(mod) or "").split("\n\n")[0]
        if summary:
            out.append(f'<pre class="zo-doc">{html.escape(summary)}</pre>\n')
        for name in names:
            obj = getattr(mod, name, None)
            if obj is None:
                continue
            kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "data"
            out.append(f"### `{mod.__name__}.{name}`\n")
            where = _defined_in(obj) if kind != "data" else None
            src = source_page_for(where) if where else None
            sig = _signature(obj) if kind != "data" else f" = {html.escape(repr(obj))[:200]}"
            out.append(f'<pre class="zo-sig"><code>{kind} {html.escape(name + sig)}</code></pre>\n')
            if src:
                out.append(f"Defined in [`{where}`]({src}).\n")
            if kind != "data":
                out.append(_doc_block(obj))
            if inspect.isclass(obj):
                for mname, member in inspect.getmembers(obj):
                    if mname.startswith("_") or mname not in obj.__dict__:
                        continue
                    raw = obj.__dict__[mname]
                    if isinstance(raw, property):
                        out.append(f'<pre class="zo-sig"><code>property {html.escape(mname)}</code></pre>\n')
                        out.append(_doc_block(raw))
                    elif callable(member):
                        out.append(
                            f'<pre class="zo-sig"><code>{html.escape(name)}.{html.escape(mname)}'
                            f"{html.escape(_signature(member))}</code></pre>\n"
                        )
                        out.append(
                            _doc_block(
                                raw if not isinstance(raw, (staticmethod, classmethod)) else member, own=True
                            )
                        )
    return "\n".join(out)
