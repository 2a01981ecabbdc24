"""Byte sizes as people write them ("512MB", "1.5 GiB") and as tables print them."""

from __future__ import annotations

import math
import re

# SI prefixes are powers of 1000, IEC prefixes powers of 1024: "512MB" and "512MiB" differ by 5%,
# and a course about memory should not blur them.
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Return a byte count from an int or a string such as "512MB", "2GiB" or "1e9"."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative, got {value!r}")
        return int(_finite(value, value))
    match = _PATTERN.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"cannot read {value!r} as a byte size; write a number with an optional unit, "
            "e.g. 536870912, '512MiB' or '0.5GB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(_finite(float(match.group(1)) * _UNITS[unit], value))


def _finite(size: float, written) -> float:
    # "1e400MB" and JSON's Infinity read as an infinite float, and int() of one is an OverflowError.
    if not math.isfinite(size):
        raise ValueError(
            f"{written!r} is not a finite byte size; write a size a machine can have, e.g. '512MiB' or '80GB'"
        )
    return size


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: 1536 -> '1.50 KiB'."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_gb(num_bytes: float) -> str:
    """Decimal gigabytes, the unit GPU data sheets and the ZeRO papers use: 208e9 -> '208.0 GB'."""
    return f"{num_bytes / 1e9:.1f} GB"
