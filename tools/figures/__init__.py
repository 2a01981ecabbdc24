"""The course's figures, one module per subject. Each module names its figures in `FIGURES`
({file name: function that draws it into a path}); `python -m tools.draw_figures` draws them all.

Every figure is drawn from committed outputs (course/measured/, the lessons' stored outputs) or from arithmetic
stated in its module, never by hand, and a second run writes the same bytes."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path

Draw = Callable[[Path], Path]


def collect() -> dict[str, Draw]:
    """Every figure of every module in this package, by file name; a name drawn twice is an error."""
    figures: dict[str, Draw] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for name, draw in getattr(module, "FIGURES", {}).items():
            if name in figures:
                raise ValueError(f"figure {name} is drawn by two modules (the second: {info.name})")
            figures[name] = draw
    return figures
