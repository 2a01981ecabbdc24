"""Chapter 4's measured figures, parsed from committed outputs (no number is typed in here):

- adam-roofline.png:  the fp32 Adam step of every implementation against the memory floor, in GB/s, on the two
                      CPUs whose `make bench` output is committed (course/measured/bench-adam-*.txt: a 2-core
                      AMD EPYC Zen 5 VM and a 2-core Intel Xeon VM), side by side;
- adam-threads.png:   thread scaling of the C kernel, torch's fused Adam and the memory floor: ms per step of
                      4,000,000 parameters against threads, from the stored output of lessons/04_tuning.ipynb,
                      section 4 (ms = parameters / (million parameters a second) / 1000: stated arithmetic).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt

from .style import CPU, CPU_LIGHT, EDGE, GPU, INK, LINK, save

REPO = Path(__file__).resolve().parents[2]
MEASURED = REPO / "course" / "measured"
BENCH_FILES = {
    "AMD EPYC Zen 5, 2-core VM": MEASURED / "bench-adam-amd-epyc-zen5.txt",
    "Intel Xeon, 2-core VM": MEASURED / "bench-adam-intel-xeon.txt",
}
NOTEBOOK = REPO / "lessons" / "04_tuning.ipynb"
FLOOR = "memory floor (no arithmetic)"

# ---------------------------------------------------------------------------------------------------------------
# 1. the Adam step of each implementation against the memory floor


@dataclass(frozen=True)
class Row:
    name: str  # as `make bench` prints it
    ms: float
    gb_per_s: float
    of_floor: int  # per cent


ROW = re.compile(r"^(?P<name>\S.*?)\s+(?P<ms>[\d.]+)\s+[\d.]+x\s+\d+\s+(?P<gbs>[\d.]+)\s+(?P<floor>\d+)%\s*$")


def parse_adam_table(text: str) -> list[Row]:
    """The rows of the "Adam step over ... fp32 parameters" table of a `make bench` output, in its order."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Adam step over "))
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        if m := ROW.match(line):
            rows.append(Row(m["name"], float(m["ms"]), float(m["gbs"]), int(m["floor"])))
    if not any(row.name == FLOOR for row in rows):
        raise ValueError("the Adam table has no memory-floor row")
    return rows


def adam_tables() -> dict[str, list[Row]]:
    return {cpu: parse_adam_table(path.read_text(encoding="utf-8")) for cpu, path in BENCH_FILES.items()}


def _color(name: str) -> str:
    if name == FLOOR:
        return EDGE
    if name.startswith("ours"):
        return CPU if "scalar" not in name else CPU_LIGHT
    return LINK if "torch" in name else "#bbbbbb"


def draw_adam_roofline(path: Path) -> Path:
    tables = adam_tables()
    fig, axes = plt.subplots(1, len(tables), figsize=(11, 5.2), sharey=True)
    for ax, (cpu, rows) in zip(axes, tables.items(), strict=True):
        floor = next(row for row in rows if row.name == FLOOR)
        names = [row.name for row in rows]
        ys = range(len(rows))
        ax.barh(ys, [row.gb_per_s for row in rows], color=[_color(n) for n in names], edgecolor=EDGE)
        ax.axvline(floor.gb_per_s, color=INK, linestyle="--", linewidth=1.2)
        ax.text(
            floor.gb_per_s * 1.02,
            0.5,
            f"memory floor\n{floor.gb_per_s:g} GB/s",
            fontsize=8,
            va="center",
            ha="left",
        )
        for y, row in zip(ys, rows, strict=True):
            ax.text(row.gb_per_s + 0.6, y, f"{row.ms:g} ms, {row.of_floor}%", va="center", fontsize=8)
        ax.set_yticks(list(ys), names, fontsize=8)  # the floor on top, naive at the bottom
        ax.set_xlim(0, floor.gb_per_s * 1.45)
        ax.set_xlabel("GB/s moved (28 bytes a parameter)")
        ax.set_title(cpu, fontsize=10)
    fig.suptitle(
        "fp32 Adam step, 16,700,000 parameters, make bench: every one-pass implementation ends at the floor",
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, path)


# ---------------------------------------------------------------------------------------------------------------
# 2. thread scaling (lessons/04_tuning.ipynb, section 4)


@dataclass(frozen=True)
class ThreadSweep:
    parameters: int
    kinds: tuple[str, ...]
    rates: dict[str, tuple[float, ...]]  # million parameters a second, by kind, for threads 1, 2, ...

    def ms(self, kind: str) -> tuple[float, ...]:
        """ms a step of `parameters`, from the rates: parameters / (rate x 1e6) x 1000."""
        return tuple(self.parameters / (rate * 1e6) * 1000 for rate in self.rates[kind])


THREADS_HEADER = re.compile(r"^([\d,]+) parameters, cold caches; million parameters/s")


def _outputs(notebook: Path) -> list[str]:
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    texts = []
    for cell in cells:
        for output in cell.get("outputs", []):
            if "text" in output:
                texts.append("".join(output["text"]))
    return texts


def parse_thread_table(text: str) -> ThreadSweep:
    """The thread table the notebook prints (tuning_threads.format_threads)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if THREADS_HEADER.match(line))
    parameters = int(THREADS_HEADER.match(lines[start])[1].replace(",", ""))
    header = lines[start + 2]
    if not header.startswith("threads"):
        raise ValueError(f"not the thread table's header: {header!r}")
    kinds = tuple(k.strip() for k in re.split(r"\s{2,}", header.strip())[1:])
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    for n, line in enumerate(lines[start + 3 :], start=1):
        if not line.strip():
            break
        fields = line.split()
        if int(fields[0]) != n:
            raise ValueError(f"thread row {n} reads {line!r}")
        values = [float(v) for v in re.findall(r"(\d+(?:\.\d+)?) \(", line)]
        for kind, value in zip(kinds, values, strict=True):
            rates[kind].append(value)
    return ThreadSweep(parameters, kinds, {k: tuple(v) for k, v in rates.items()})


def thread_sweep() -> ThreadSweep:
    for text in _outputs(NOTEBOOK):
        if any(THREADS_HEADER.match(line) for line in text.splitlines()):
            return parse_thread_table(text)
    raise ValueError(f"{NOTEBOOK.name} has no stored thread table")


def draw_adam_threads(path: Path) -> Path:
    sweep = thread_sweep()
    styles = {
        "C fp32": (CPU, "o", "-"),
        "C fp32 -> fp16": (CPU_LIGHT, "s", "-"),
        "torch fused": (LINK, "^", "-"),
        "memory floor": (EDGE, "", "--"),
    }
    fig, ax = plt.subplots(figsize=(10, 5))
    for kind in sweep.kinds:
        color, marker, line = styles.get(kind, (GPU, "d", "-"))
        ms = sweep.ms(kind)
        threads = range(1, len(ms) + 1)
        ax.plot(threads, ms, color=color, marker=marker, linestyle=line, linewidth=1.8, label=kind)
    ax.set_xticks(range(1, len(sweep.ms(sweep.kinds[0])) + 1))
    ax.set_xlabel("threads (the VM has 2 cores)")
    ax.set_ylabel(f"ms a step, {sweep.parameters:,} parameters (lower is faster)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="lower right")
    ax.set_title(
        "Adam step against threads, cold caches (lessons/04_tuning.ipynb, section 4): flat once memory is saturated;\n"
        "the 2-thread bump of the C kernel and the floor is specific to that VM (appendix 4.A)",
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, path)


FIGURES = {"adam-roofline.png": draw_adam_roofline, "adam-threads.png": draw_adam_threads}
