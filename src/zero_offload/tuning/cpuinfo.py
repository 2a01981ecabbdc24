"""What this CPU is: its model name and its caches, as the operating system reports them.

The CPU Adam is bound by memory, and "memory" means the last-level cache when the optimizer states fit in it:
how large that cache is decides which of two speeds a step runs at. The probes (bandwidth.py) size their
buffers from it, and `make bench` prints it beside every timing, so that a number measured on one machine is
never read as another's. Linux reports the caches in sysfs, macOS through sysctl; elsewhere (or in a container
that hides them) every size is None and the callers say so instead of guessing.
"""

from __future__ import annotations

import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

SYSFS_CPU = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class Caches:
    """Bytes of one L1 data cache, one L2 and one L3 (None: not reported), and how many L3s the CPUs have."""

    l1d: int | None = None
    l2: int | None = None
    l3: int | None = None
    l3_instances: int = 1

    @property
    def last_level(self) -> int | None:
        """The whole last-level cache of the CPUs this process sees: every L3 (or, without one, the L2)."""
        return self.l3 * self.l3_instances if self.l3 else self.l2

    def describe(self) -> str:
        def size(n):
            return "?" if n is None else f"{n // 2**20} MiB" if n >= 2**20 else f"{n // 2**10} KiB"

        count = f" x {self.l3_instances}" if self.l3 and self.l3_instances > 1 else ""
        return f"L1d {size(self.l1d)}, L2 {size(self.l2)}, L3 {size(self.l3)}{count}"


def _size(text: str) -> int | None:
    """sysfs writes "48K", "1024K", "32768K" (sometimes "2M"); None for anything else."""
    match = re.fullmatch(r"(\d+)\s*([KMG]?)", text.strip())
    if not match:
        return None
    return int(match[1]) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[match[2]]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _sysfs_caches(root: Path) -> Caches | None:
    found, l3_sharing = {}, set()
    for cpu in sorted(root.glob("cpu[0-9]*")):
        for index in sorted((cpu / "cache").glob("index[0-9]*")):
            level, kind = _read(index / "level"), _read(index / "type")
            key = {("1", "Data"): "l1d", ("2", "Unified"): "l2", ("3", "Unified"): "l3"}.get((level, kind))
            if key is None:
                continue
            if cpu.name == "cpu0":
                found[key] = _size(_read(index / "size") or "")
            if key == "l3":  # CPUs that share one L3 list the same CPUs: one entry per L3
                l3_sharing.add(_read(index / "shared_cpu_list"))
    if not found:
        return None
    return Caches(**found, l3_instances=max(1, len(l3_sharing)))


def _sysctl(name: str) -> str | None:
    try:
        run = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() if run.returncode == 0 and run.stdout.strip() else None


def cpu_caches(root: Path = SYSFS_CPU) -> Caches:
    """This machine's caches: sysfs on Linux, sysctl on macOS; sizes it does not report are None."""
    if root.is_dir():
        caches = _sysfs_caches(root)
        if caches is not None:
            return caches
    if platform.system() == "Darwin":
        sizes = {key: _sysctl(f"hw.{key}cachesize") or "" for key in ("l1d", "l2", "l3")}
        return Caches(**{key: int(v) if v.isdigit() and int(v) > 0 else None for key, v in sizes.items()})
    return Caches()


def cpu_model() -> str:
    """The CPU's name as the OS gives it ("AMD EPYC 9R45", "Intel(R) Xeon(R) ..."), else the architecture."""
    cpuinfo = _read(Path("/proc/cpuinfo")) or ""
    for line in cpuinfo.splitlines():
        if line.startswith(("model name", "Model")):  # x86 / Arm
            return line.split(":", 1)[1].strip()
    return _sysctl("machdep.cpu.brand_string") or platform.processor() or platform.machine() or "unknown CPU"
