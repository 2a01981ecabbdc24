"""The argument types the `zo` commands share: a parameter count ("13B") and a byte size ("80GB")."""

from __future__ import annotations

import argparse

from ..units import parse_bytes

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """'13B' -> 13_000_000_000, '350M' -> 350_000_000, '1e9' -> 1_000_000_000."""
    text = text.strip().upper()
    try:
        if text and text[-1] in _SUFFIXES:
            return int(float(text[:-1]) * _SUFFIXES[text[-1]])
        return int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a parameter count (e.g. 13B, 350M, 1e9)"
        ) from None


def parse_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
