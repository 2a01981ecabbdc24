"""What every course figure shares: one colour per place, the resolution, and a save that writes the same bytes
for the same drawing. Labels are English: matplotlib's default font has no CJK glyphs."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DPI = 150

# One colour per place, the same in every figure.
GPU = "#2e8b57"  # device memory and device compute
CPU = "#3a6ea5"  # host memory and host compute
LINK = "#e08a1e"  # PCIe copies (D2H and H2D)
NVME = "#8e5ea2"  # the NVMe tier
GPU_LIGHT = "#b9e0c8"
CPU_LIGHT = "#bfd3ea"
LINK_LIGHT = "#f6d2a2"
INK = "#222222"
HOLLOW = "#ffffff"
EDGE = "#555555"


def save(fig, path: Path) -> Path:
    # No "Software" key: the file then depends on nothing but the drawing.
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return path


def canvas(width: float, height: float):
    """A figure whose single axes spans it and whose data units are inches: (0, 0) bottom left."""
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    return fig, ax
