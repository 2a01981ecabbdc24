"""Reading one section of the JSON: pop the keys we know, with type checks, then complain about whatever is left.

The section parsers (sections.py, extension.py, load.py) are written against `Section`; every error it raises
names the key path, and an unknown key comes with the closest known one ("did you mean ...").
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Callable
from typing import Any

from .schema import ConfigError

SIZE = "size"  # a count DeepSpeed users write as 5e8: an int, or a float with an integral value
_KIND_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "a list",
    SIZE: "a whole number such as 500000000 or 5e8",
}

# Value rules for Section.get(..., **POSITIVE): the check, and the words the error uses for it.
POSITIVE = dict(check=lambda v: v > 0, need="> 0")
NON_NEGATIVE = dict(check=lambda v: v >= 0, need=">= 0")
AT_LEAST_1 = dict(check=lambda v: v >= 1, need=">= 1")


def describe(value) -> str:
    shown = json.dumps(value) if isinstance(value, str) else repr(value)
    return f"{shown} ({type(value).__name__})"


def convert(path: str, value, kind):
    """`value` as `kind` (bool, int, float, str, list or SIZE), or a ConfigError naming `path`."""
    # bool is an int in Python, but in a config `"stage": true` is a mistake, not stage 1.
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    accepted = {
        bool: isinstance(value, bool),
        int: number and isinstance(value, int),
        float: number,
        str: isinstance(value, str),
        list: isinstance(value, (list, tuple)),
        SIZE: number and (isinstance(value, int) or value.is_integer()),
    }[kind]
    if accepted and number and not math.isfinite(value):
        # JSON readers accept Infinity and NaN; a learning rate or an eps of either poisons every weight.
        raise ConfigError(path, f"{path} must be a finite number, got {describe(value)}")
    if accepted:
        return float(value) if kind is float else int(value) if kind is SIZE else value
    hint = ""
    if isinstance(value, str) and kind is not str:
        hint = '; write the value without quotes, e.g. 2 or true rather than "2" or "true"'
    raise ConfigError(path, f"{path} must be {_KIND_NAMES[kind]}, got {describe(value)}{hint}")


class Section:
    """One JSON object of the config. `ignored` is shared by all sections of one load: the keys to warn about."""

    def __init__(self, data, path: str, ignored: list[str]):
        if not isinstance(data, dict):
            where = f"section '{path}'" if path else "the top level of the config"
            raise ConfigError(path, f"{where} must be a JSON object {{...}}, got {describe(data)}")
        self.data, self.path, self.ignored = dict(data), path, ignored
        self.known: set[str] = set()  # every key asked about: the candidates for a did-you-mean
        self.tolerated: set[str] = set()  # the known keys that ignore() accepts without using them

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def has(self, name: str) -> bool:
        self.known.add(name)
        return name in self.data

    def get(
        self,
        name: str,
        kind,
        default=None,
        *,
        check: Callable[[Any], bool] | None = None,
        need: str = "",
        optional: bool = False,
    ):
        """Pop `name`, check its type, then `check(value)`, whose rule `need` goes into the error."""
        if not self.has(name):
            return default
        value = self.data.pop(name)
        if value is None and optional:
            return None
        value = convert(self.key(name), value, kind)
        if check is not None and not check(value):
            raise ConfigError(self.key(name), f"{self.key(name)} must be {need}, got {describe(value)}")
        return value

    def choice(self, name: str, allowed: tuple[str, ...], default: str | None = None) -> str:
        """One of `allowed`, matched case-insensitively, spelled as in `allowed`; required if no default."""
        if default is None and not self.has(name):
            raise ConfigError(
                self.key(name), f"{self.key(name)} is missing; allowed values: {', '.join(allowed)}"
            )
        value = self.get(name, str, default)
        canonical = {a.lower(): a for a in allowed}.get(value.lower())
        if canonical is None:
            raise ConfigError(
                self.key(name),
                f"{self.key(name)} = {json.dumps(value)} is not supported by "
                f"zero_offload; allowed values: {', '.join(allowed)}",
            )
        return canonical

    def section(self, name: str) -> Section:
        self.has(name)
        return Section(self.data.pop(name, {}), self.key(name), self.ignored)

    def ignore(self, *names: str, hints: dict[str, str] | None = None) -> None:
        """Keys we accept and that have no effect here: load_config warns once about all of them, each with its
        hint, if `hints` has one (what to write instead)."""
        self.tolerated.update(names)
        for name in names:
            if self.has(name):
                self.data.pop(name)
                hint = (hints or {}).get(name)
                self.ignored.append(self.key(name) + (f" ({hint})" if hint else ""))

    def refuse(self, name: str, why: str) -> None:
        """A DeepSpeed switch for a feature we do not have: false is fine, true is an error."""
        if self.get(name, bool, False):
            raise ConfigError(self.key(name), f"{self.key(name)} = true: {why}")

    def done(self) -> None:
        """Whatever is still in the section was never asked for: an unknown key."""
        for name in self.data:
            path = self.key(str(name))
            close = difflib.get_close_matches(str(name), self.known, n=1)
            guess = f"; did you mean '{close[0]}'?" if close else ""
            where = f" in {self.path}" if self.path else ""
            raise ConfigError(
                path,
                f"unknown key '{path}'{guess} allowed keys{where}: "
                f"{', '.join(sorted(self.known - self.tolerated))}",
            )


def reject_auto(value, path: str = "") -> None:
    """Refuse the Hugging Face Trainer's "auto" placeholder anywhere in the tree, naming where it is."""
    if value == "auto":
        raise ConfigError(
            path,
            "'auto' is filled in by the Hugging Face Trainer integration; zero_offload "
            f"needs a concrete value for {path}",
        )
    if isinstance(value, dict):
        for k, v in value.items():
            reject_auto(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            reject_auto(v, f"{path}[{i}]")
