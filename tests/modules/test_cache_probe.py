"""The cache probe's arithmetic (tuning/cache_probe.py, module 4): how many bytes of optimizer states the cache
keeps, read from probes of growing size."""

from __future__ import annotations

from zero_offload.tuning.cache_probe import cache_bytes_from_probes

MiB = 2**20


def test_the_cache_bytes_are_twice_where_the_probes_cross_halfway():
    probes = [(8 * MiB, 4e9), (16 * MiB, 4e9), (24 * MiB, 2.5e9), (32 * MiB, 1.6e9), (64 * MiB, 1e9)]
    # Halfway between 1/4e9 and 1/1e9 is 0.625 ns a parameter: between 16 MiB (0.25) and 24 MiB (0.4) it is
    # not, between 24 and 32 MiB (0.625) exactly at 32 MiB.
    assert cache_bytes_from_probes(probes, 4e9) == 64 * MiB
    assert cache_bytes_from_probes(probes[:2] + [(32 * MiB, 1e9)], 4e9) == 2 * (16 + 16 * 0.375 / 0.75) * MiB
    flat = [(8 * MiB, 1e9), (64 * MiB, 1.05e9)]  # no probe faster than halfway: the cache keeps nothing
    assert cache_bytes_from_probes(flat, 1.05e9) == 0
    # The smallest states slower than the next (a call weighs more on them): the search starts at the fastest.
    slow_start = [(8 * MiB, 2e9), (16 * MiB, 4e9), (32 * MiB, 1e9)]
    assert cache_bytes_from_probes(slow_start, 4e9) == 2 * (16 + 16 * 0.375 / 0.75) * MiB
