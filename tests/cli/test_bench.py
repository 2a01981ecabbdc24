"""`make bench` helpers (the benchmark itself reports ratios and is run by `make bench`, not by the tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zero_offload.cli.bench import adam as bench_adam
from zero_offload.cli.bench import cpu as bench_cpu
from zero_offload.cli.bench import run as bench
from zero_offload.cli.bench.timing import _busy_fraction, wait_until_quiet


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) != os.cpu_count(),
    reason="/proc/stat counts every core of the machine: this process must be allowed on all of them",
)
def test_timing_waits_while_something_else_keeps_the_cores_busy():
    cores = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        busy = _busy_fraction(0.5)
        assert busy is not None and busy > 0.5
        assert wait_until_quiet(limit=3.0) >= 3.0  # never quiet: it gives up at the limit rather than hang
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def test_a_bench_section_replaces_its_own_results_and_keeps_the_others(tmp_path, monkeypatch, capsys):
    (tmp_path / "results.json").write_text(json.dumps({"adam": {"kept": True}}), encoding="utf-8")
    overhead = {"params": 1e6, "batch": 8, "median_ms": {"plain": 10.0, "offload": 11.0}, "ratio": 1.1}
    monkeypatch.setattr(bench, "offload_overhead", lambda: overhead)
    results = bench.run_bench(tmp_path, only=("overhead",))
    saved = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert saved == results == {"adam": {"kept": True}, "offload_overhead": overhead}
    assert "offload / plain" in capsys.readouterr().out
    with pytest.raises(ValueError, match="bench sections are adam, update"):
        bench.run_bench(tmp_path, only=("adam", "speed"))


def test_the_cpu_sections_report_the_machine_and_never_judge(capsys):
    machine = bench_cpu.machine()
    assert machine["cpu"] and "L1d" in machine["caches_text"]
    assert machine["kernel_variant"] in (None, "scalar", "avx2", "avx512")
    case = {"params": 4_200_000, "tensors": 16, "state_bytes": 67_000_000, "cached_share": 0.0,
            "measured_ms": 3.3, "predicted_ms": 2.5, "measured_over_predicted": 1.32, "within_tolerance": False}  # fmt: skip
    bench_cpu.print_model_vs_engine({"machine": machine, "calibration": "calibrated: ...", "rounds": 5,
                                     "cases": {"4.2M params in 16 tensors": case}})  # fmt: skip
    out = capsys.readouterr().out
    assert "CPU: " in out and "caches: L1d" in out and "1.32  no" in out
    ms = {
        "ours avx2 x2": {"quiet": 10.0, "after a torch op": 12.5},
        "torch fused": {"quiet": 10.0, "after a torch op": 10.0},
    }
    bench_cpu.print_after_torch_op({"numel": 1000, "threads": 2, "rounds": 7, "median_ms": ms, "spin_ms": 6.0,
                                    "ours_vs_fused": {"quiet": 1.0, "after a torch op": 0.8}, "machine": machine})  # fmt: skip
    out = capsys.readouterr().out
    assert "1.00x" in out and "0.80x" in out and "burnt 6.0 ms" in out


def test_the_floor_is_the_faster_of_plain_and_streaming_stores():
    ms = {"bf16 x2": 9.0, "bf16 x2 floor": 8.0, "bf16 x2 floor, streaming output": 7.0}
    assert bench_adam.floor_stores(ms, "bf16 x2 floor") == (7.0, "streaming")
    assert ms == {"bf16 x2": 9.0}, "both floors leave the timings"
    assert bench_adam.floor_stores({"f": 6.0, "f, streaming output": 7.5}, "f") == (6.0, "plain")
    assert bench_adam.floor_stores({"f": 6.0}, "f") == (6.0, "plain")  # a CPU without streaming stores
    assert bench_adam.floor_stores({}, "f") == (None, None)  # no C Adam: no floor


def test_a_narrow_step_is_told_what_share_of_its_floor_its_target_needs():
    def row(precision, ms, floor_ms, fp32_ms):
        return {"precision": precision, "ms": ms, "floor_ms": floor_ms, "fp32_ms": fp32_ms}

    # 1.6 x 5.0 / 8.0: the int8 step must run at its floor exactly; at 5.0 ms it does (1.6x, 100%)
    assert bench_adam.target_verdict(row("int8", 5.0, 5.0, 8.0)) == (pytest.approx(1.0), "met")
    # fast enough against fp32 (1.6x) but at 83% of its floor: missed
    assert bench_adam.target_verdict(row("int8", 5.0, 4.15, 8.0))[1] == "missed"
    # at its floor (100%) but fp32 / floor is only 1.5: out of reach, needs 107%
    needs, goal = bench_adam.target_verdict(row("int8", 4.0, 4.0, 6.0))
    assert goal == "missed" and needs == pytest.approx(1.6 * 4 / 6)
    # bf16: 1.3 x 6.0 / 8.4 = 93%; at 6.1 ms it is 1.38x and 98% of its floor
    needs, goal = bench_adam.target_verdict(row("bf16", 6.1, 6.0, 8.4))
    assert goal == "met" and needs == pytest.approx(1.3 * 6.0 / 8.4)
    assert bench_adam.target_verdict(row("fp32", 8.4, 8.3, 8.4)) == (None, "-")


def test_the_kernel_sections_run_small_and_say_which_floor_they_used(capsys, monkeypatch, tmp_path):
    pytest.importorskip("cffi")
    from zero_offload.tuning import variant_choice

    # the engine's choice, measured on a small sample into a fresh cache: each row names the variant it ran
    bench_adam._c_variants()  # builds (or loads) the kernel from the usual cache first
    monkeypatch.setenv("ZO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(variant_choice, "sample_size", lambda: 1 << 14)
    states = bench_adam.moment_precisions(numel=3 * 2**16 + 5, rounds=1, threads=2)
    update = bench_adam.offload_update(numel=3 * 2**16 + 5, rounds=1, threads=2)
    if not states["rows"]:
        pytest.skip("the C Adam cannot be built here")
    assert {(r["precision"], r["threads"]) for r in states["rows"]} == {
        (p, t) for p in ("fp32", "bf16", "int8") for t in (1, 2)
    }
    chosen = variant_choice.cached_choices(tmp_path)
    for row in states["rows"]:
        assert row["floor_ms"] > 0 and row["floor_stores"] in ("plain", "streaming")
        assert (
            row["variant"] == chosen[variant_choice.choice_key(row["threads"], row["precision"])]["variant"]
        )
    assert update["floor_ms"] > 0 and update["floor_stores"] in ("plain", "streaming")
    bench_adam.print_moment_precisions(states)
    bench_adam.print_offload_update(update)
    out = capsys.readouterr().out
    assert "stores" in out and "int8 x2" in out and "memory floor (28 bytes a parameter)" in out
    int8_row = next(line for line in out.splitlines() if line.startswith("int8 x2"))
    assert int8_row.split()[-1] in ("met", "missed") and int8_row.split()[-2].endswith("%"), int8_row
