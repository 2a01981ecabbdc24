"""What the CPU is (tuning.cpuinfo): its caches from sysfs, and nothing invented where the OS says nothing."""

from __future__ import annotations

from zero_offload.tuning.cpuinfo import Caches, cpu_caches, cpu_model


def _cache(root, cpu, index, level, kind, size, shared):
    folder = root / f"cpu{cpu}" / "cache" / f"index{index}"
    folder.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (folder / name).write_text(f"{value}\n")


def test_caches_are_read_from_sysfs_and_l3s_counted_by_the_cpus_that_share_them(tmp_path):
    for cpu in range(4):  # two L3s of 32 MiB, each shared by two CPUs
        _cache(tmp_path, cpu, 0, 1, "Data", "48K", cpu)
        _cache(tmp_path, cpu, 1, 1, "Instruction", "32K", cpu)
        _cache(tmp_path, cpu, 2, 2, "Unified", "1024K", cpu)
        _cache(tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3")
    caches = cpu_caches(tmp_path)
    assert caches == Caches(l1d=48 * 2**10, l2=2**20, l3=32 * 2**20, l3_instances=2)
    assert caches.last_level == 64 * 2**20
    assert caches.describe() == "L1d 48 KiB, L2 1 MiB, L3 32 MiB x 2"


def test_without_an_l3_the_last_level_is_the_l2_and_unreported_sizes_stay_unknown(tmp_path):
    _cache(tmp_path, 0, 0, 1, "Data", "64K", 0)
    _cache(tmp_path, 0, 2, 2, "Unified", "2M", 0)
    caches = cpu_caches(tmp_path)
    assert (caches.l1d, caches.l2, caches.l3, caches.last_level) == (64 * 2**10, 2 * 2**20, None, 2 * 2**20)
    assert Caches().last_level is None and Caches().describe() == "L1d ?, L2 ?, L3 ?"


def test_this_machine_is_described_whatever_it_reports():
    caches = cpu_caches()
    assert all(size is None or size > 0 for size in (caches.l1d, caches.l2, caches.l3))
    assert isinstance(cpu_model(), str) and cpu_model()
