"""Chapter 4's figures read their numbers from committed outputs: the parsed data must be the file's."""

from __future__ import annotations

import pytest

from tools.figures import tuning


@pytest.fixture(scope="module")
def tables():
    return tuning.adam_tables()


def test_both_committed_bench_files_parse_with_every_implementation(tables):
    assert set(tables) == set(tuning.BENCH_FILES)
    for rows in tables.values():
        names = [row.name for row in rows]
        assert names[0] == "naive (basics.Adam)" and names[-1] == tuning.FLOOR
        assert {"torch fused", "ours avx2 x2", "ours scalar x1"} <= set(names)
        assert len(rows) == 10


def test_the_floor_row_is_100_per_cent_and_the_naive_step_is_far_from_it(tables):
    for rows in tables.values():
        floor = next(row for row in rows if row.name == tuning.FLOOR)
        assert floor.of_floor == 100
        naive = rows[0]
        assert naive.ms > 4 * floor.ms and naive.of_floor < 25
        # GB/s and ms say the same: time x rate is the same bytes for every row (28 B x 16.7M), within rounding
        for row in rows:
            assert row.ms * row.gb_per_s == pytest.approx(floor.ms * floor.gb_per_s, rel=0.08)


def test_the_values_are_the_files(tables):
    amd = {row.name: row for row in tables["AMD EPYC Zen 5, 2-core VM"]}
    text = tuning.BENCH_FILES["AMD EPYC Zen 5, 2-core VM"].read_text(encoding="utf-8")
    for row in amd.values():
        line = next(line for line in text.splitlines() if line.startswith(row.name + " "))
        assert f"{row.ms:.1f}" in line and f"{row.gb_per_s:.1f}" in line and f"{row.of_floor}%" in line
    assert amd["torch fused"].of_floor == 102 and amd["ours avx2 x2"].of_floor == 98


def test_the_thread_sweep_is_the_notebooks_stored_table():
    sweep = tuning.thread_sweep()
    assert sweep.parameters == 4_000_000
    assert sweep.kinds == ("C fp32", "C fp32 -> fp16", "torch fused", "memory floor")
    assert all(len(rates) == len(sweep.rates["C fp32"]) >= 2 for rates in sweep.rates.values())
    assert sweep.rates["C fp32"][0] == 1673 and sweep.rates["memory floor"][0] == 1762
    # ms a step is parameters / rate: the floor at one thread is the fastest one-thread step
    one = {kind: sweep.ms(kind)[0] for kind in sweep.kinds}
    assert min(one, key=one.get) == "memory floor"
    assert sweep.ms("C fp32")[0] == pytest.approx(4_000_000 / 1673e6 * 1000)


def test_the_thread_parser_refuses_a_table_whose_rows_skip_a_count():
    text = (
        "8 parameters, cold caches; million parameters/s (GB/s); medians of 1 rounds\n\n"
        "threads            C fp32      memory floor\n"
        "      1       10 (1.0)       20 (2.0)\n"
        "      3       10 (1.0)       20 (2.0)\n"
    )
    with pytest.raises(ValueError, match="thread row 2"):
        tuning.parse_thread_table(text)
