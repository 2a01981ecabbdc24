"""The measurement helpers lessons 4 and 5 call (zero_offload.lessons): structure and small cases, no timings.

Every size here is tiny: the tests check what each helper returns and that its checks hold (bit-identity,
sentinels, rounding), not how fast anything ran.
"""

from __future__ import annotations

import matplotlib
import pytest
import torch

from zero_offload.lessons import (
    practice_dpu,
    practice_nvme,
    practice_runs,
    practice_steps,
    tuning_kernel,
    tuning_moments,
    tuning_partial,
    tuning_plots,
    tuning_threads,
)
from zero_offload.practice.timeline import Span
from zero_offload.tuning import build, perfmodel
from zero_offload.tuning.cpu_adam import supported_variants
from zero_offload.workloads import load_corpus

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def kernel():
    return build.build()


# Lesson 4: the kernel


def test_raw_kernel_updates_its_own_buffers(kernel):
    call = tuning_kernel.raw_kernel(kernel, 64, variant="scalar")
    w = call.__defaults__[0][0]  # the closure keeps (w, g, m, v, args)
    call()
    assert bool((w != 0).any())
    tuning_kernel.raw_kernel(kernel, 64, floor=True)()  # the memory floor runs on the same arguments


def test_roofline_sweep_has_every_kind_and_size(kernel):
    sizes = [4096, 8192]
    gbs = tuning_kernel.roofline_sweep(kernel, sizes, elements=8192, rounds=1)
    assert set(gbs) == {(k, n) for k in tuning_kernel.SWEEP_KINDS for n in sizes}
    assert all(v > 0 for v in gbs.values())
    table = tuning_kernel.format_sweep(gbs, sizes)
    assert "C avx2:" in table and table.count("\n") >= len(sizes) + 1


def test_source_excerpt_spans_its_markers():
    lines = ["a", "BEGIN x", "b", "END x", "c"]
    assert tuning_kernel.source_excerpt("BEGIN x", "END x", lines) == ["BEGIN x", "b", "END x"]
    assert (
        tuning_kernel.source_excerpt("BEGIN LAB 4.3", "END LAB 4.3")[-1].strip().startswith("/* END LAB 4.3")
    )


@pytest.mark.parametrize("adamw", [False, True])
def test_run_ours_follows_torch(adamw):
    reference = tuning_kernel.run_torch(1003, 3, adamw=adamw)
    for variant in supported_variants():
        w, _ = tuning_kernel.run_ours(1003, 3, adamw=adamw, variant=variant)
        torch.testing.assert_close(w, reference, rtol=1e-5, atol=1e-6)


def test_parity_report_names_every_variant():
    report = tuning_kernel.parity_report(257, 2)
    for variant in supported_variants():
        assert f" {variant} " in report
    assert "torch.optim.AdamW" in report


def test_tail_rows_update_everything_and_keep_the_guard():
    rows = tuning_kernel.tail_rows((1, 8, 9, 17))
    assert [r[0] for r in rows] == [1, 8, 9, 17]
    assert all(vector + tail == n and updated and intact for n, vector, tail, updated, intact in rows)


def test_rounding_rows_are_bit_identical_on_the_edge_cases():
    rows = tuning_kernel.rounding_rows(torch.tensor(tuning_kernel.EDGES))
    assert {r[0] for r in rows} == {"float16", "bfloat16"}
    assert all(same == n == len(tuning_kernel.EDGES) for _, _, same, n in rows)


# Lesson 4: threads


def test_thread_sweep_covers_each_kind_and_thread_count():
    kinds = tuning_threads.thread_kinds(4096)
    assert [nbytes for nbytes, _ in kinds.values()] == [28, 30, 28, 28]
    rates = tuning_threads.thread_sweep(kinds, 4096, max_threads=1, rounds=1)
    assert set(rates) == {(k, 1) for k in kinds} and torch.get_num_threads() == 1
    table = tuning_threads.format_threads(rates, kinds, 4096, 1, 1, cores=1)
    assert "fastest thread count" in table


def test_call_overhead_and_contention_return_numbers():
    assert tuning_threads.call_overhead_us(1, n=64, calls=5) > 0
    contention = tuning_threads.Contention(4096, seconds=0.01)
    medians = contention.measure(((1, 1),), rounds=1)
    assert set(medians[1, 1]) == {"mm alone", "adam alone", "mm busy", "adam busy"}
    assert "work done together" in tuning_threads.format_contention(medians, 4096, cores=2)
    assert medians[1, 1]["mm alone"] > 0, "alone, the matmul loop is timed until it has done one"
    # A loop that did nothing alone (a window too short on a busy machine) gives no share, not a crash.
    idle = {(1, 1): {"mm alone": 0.0, "adam alone": 1.0, "mm busy": 0.0, "adam busy": 1.0}}
    assert "nan" in tuning_threads.format_contention(idle, 4096, cores=2)


# Lesson 4: partial offload, the model, the advice


def test_partial_config_offloads_only_with_a_ratio():
    assert "offload_optimizer" not in tuning_partial.partial_config(None)["zero_optimization"]
    offload = tuning_partial.partial_config(0.5)["zero_optimization"]["offload_optimizer"]
    assert offload == {"device": "cpu", "ratio": 0.5}


def test_partial_runs_move_bytes_to_the_host(corpus):
    runs = {ratio: tuning_partial.partial_run("nano", ratio, 2, corpus) for ratio in (None, 0.5, 1.0)}
    assert runs[None]["pcie"] == 0 and runs[None]["host_fraction"] == 0.0
    assert runs[0.5]["host"] < runs[1.0]["host"] and runs[0.5]["device"] > runs[1.0]["device"]
    assert runs[1.0]["host_fraction"] == 1.0 and len(runs[1.0]["losses"]) == 2
    assert "ratio 0.5" in tuning_partial.format_partial(runs, "nano", 2)
    calibration = tuning_partial.format_calibration(perfmodel.PRESETS["a100-80g"], runs)
    assert "measured/predicted" in calibration and "\nnone" not in calibration


def test_format_advice_keeps_only_the_named_rules():
    hw = perfmodel.PRESETS["a100-80g"]
    text = tuning_partial.format_advice(
        "t", hw, perfmodel.Workload(1_300_000_000, batch=8), 2, "optimizer", {"offload-not-needed"}
    )
    assert text.startswith("t\n") and all(
        "[offload-not-needed]" in line for line in text.splitlines()[2:] if "[" in line
    )


def test_tuning_plots_draw(kernel):
    sizes = [4096]
    gbs = {(k, 4096): 1.0 for k in tuning_kernel.SWEEP_KINDS}
    runs = {None: {"device": 1, "host": 0, "adam_s": 0.0}, 1.0: {"device": 1, "host": 2, "adam_s": 0.001}}
    wl = perfmodel.Workload(13_000_000_000, recompute=True)
    times = [perfmodel.plan(perfmodel.PRESETS["a100-80g"], wl, 2, "optimizer").time]
    figures = [
        tuning_plots.roofline_sweep(gbs, sizes, tuning_kernel.SWEEP_KINDS),
        tuning_plots.implementations({"ours avx2 x1": 1.0, "torch fused": 2.0}, 0.5, 1000),
        tuning_plots.threads({("a", 1): 1.0, ("b", 1): 2.0, ("c", 1): 1.0, ("d", 1): 1.0}, "abcd", 1, 1, 10),
        tuning_plots.partial_offload(runs, "nano"),
        tuning_plots.step_parts([1], times, 1024),
    ]
    for fig in figures:
        assert isinstance(fig, plt.Figure)
        plt.close(fig)


# Lesson 5: schedules, bit-identity


def test_offload_config_switches():
    serial = practice_steps.offload_config()
    assert serial["zero_offload"] == {"cpu_adam": {"impl": "simd"}, "overlap_offload": False}
    both = practice_steps.offload_config(
        overlap=True, dpu_start=3, cores=([0], [1]), precision="fp16", slots=2
    )
    assert both["zero_offload"]["staging_slots"] == 2 and both["fp16"]["enabled"]
    assert both["zero_offload"]["delayed_param_update"] == {"enabled": True, "start_step": 3}
    assert both["zero_offload"]["cores"] == {"device": [0], "host": [1]}


def test_phases_measure_the_tail_after_backward():
    spans = [Span("forward", 1, 0.0, 0.010), Span("backward", 1, 0.010, 0.030), Span("Adam", 1, 0.025, 0.040)]
    ms = practice_steps.phases(spans)
    assert ms == pytest.approx({"forward": 10.0, "backward": 20.0, "Adam": 15.0, "tail after backward": 10.0})


def test_format_schedules_rows():
    result = {
        "median_ms": {"serial": 100.0, "overlapped": 80.0, "delayed (DPU)": 50.0},
        "overlapped_vs_serial": 1.25,
    }
    table = practice_steps.format_schedules({"split": result}, "cores")
    assert "1.25x" in table and "2.00x" in table
    assert "DPU vs serial" not in practice_steps.format_schedules(
        {4: result}, "staging slots", dpu_ratio=False
    )
    assert "1 x 8" in practice_steps.format_token_sweep({(1, 8): result})
    plt.close(practice_steps.plot_token_sweep({(1, 8): result}, 10.0, "nano"))


def test_zoom_reads_each_schedule_from_its_timeline(corpus):
    zoomed = practice_steps.zoom("nano", 8, corpus, cores="shared", rounds=2, block=2)
    assert list(zoomed) == list(practice_steps.SCHEDULE_SWITCHES)
    assert all(r["steps"] == 1 and r["spans"] for r in zoomed.values())
    assert "tail after backward" in practice_steps.format_phases(zoomed)
    plt.close(practice_steps.draw_steps(zoomed, "t"))


def test_overlap_is_bit_identical_to_serial(corpus):
    text = practice_steps.bit_identity("nano", 2, corpus, bucket=50_000)
    assert "losses equal: True; every weight bit-identical (torch.equal): True" in text


# Lesson 5: DPU, NVMe, runs


def test_dpu_matches_the_stale_reference(corpus):
    runs = practice_dpu.dpu_runs("nano", 6, 4, (None, 2), corpus)
    assert runs["DPU from step 2"]["losses"][:3] == runs["no DPU"]["losses"][:3]
    assert "identical to no DPU: True" in practice_dpu.format_dpu(runs)
    reference = practice_dpu.stale_reference("nano", 2, 6, 4, corpus)
    assert max(abs(a - b) for a, b in zip(reference, runs["DPU from step 2"]["losses"], strict=True)) < 1e-3
    plt.close(practice_dpu.plot_dpu(runs, "nano", window=2))


def test_nvme_tier_matches_the_cpu_tier_and_survives_a_full_disk(corpus, tmp_path):
    def config(tier, b=2):
        return practice_nvme.nvme_config(tier, tmp_path, batch=2, sub_group=20_000, buffers=b)

    engines, ms = practice_nvme.tier_runs(
        "nano", {"CPU tier": config("cpu"), "NVMe": config("nvme")}, 2, corpus, batch=2
    )
    cpu = engines["CPU tier"]
    table = practice_nvme.format_tiers(engines, ms, practice_steps.weights(cpu))
    assert table.splitlines()[-1].rstrip().endswith("True") and len(ms["NVMe"]) == 2
    text = practice_nvme.disk_full_step(engines["NVMe"], cpu, "nano", corpus, batch=2, nvme_root=tmp_path)
    assert "No space left on device" in text and "temporary files left: 0" in text
    assert text.endswith("the same weights as the CPU tier: True")


def test_largest_fitting_and_host_estimates():
    v100 = perfmodel.PRESETS["v100-32g"]
    plain, offload = (
        practice_runs.largest_fitting(v100, 0, "none"),
        practice_runs.largest_fitting(v100, 2, "optimizer"),
    )
    assert 10**8 <= plain < offload
    text, limit = practice_runs.host_estimates(
        1_000_000_000, 25_000_000, total=64 * 10**9, available=32 * 10**9
    )
    assert "13B" in text and limit == pytest.approx(0.9 * 64e9 / 20)


def test_run_summaries_format():
    alone = {"d_model": 64, "params": 100, "device_peak": 1000, "next_oom": "out of memory"}
    offloaded = {"params": 400, "seconds": 1.0, "losses": [2.0, 1.0], "device_peak": 10, "host_bytes": 8000}
    assert "4.0x the parameters" in practice_runs.format_largest(2**20, 2, alone, 1.0, "small", offloaded)
    run = {
        "world_size": 2,
        "nodes": 2,
        "steps": 2,
        "ms_per_step": 5.0,
        "losses": [2.0, 1.0],
        "eval_losses": [{"loss": 1.5}],
        "traffic_elements": {"reduce_scatter": 10},
        "pcie_bytes": {},
    }
    assert "largest relative difference from one process: 0.0e+00" in practice_runs.format_two_nodes(
        run, run, 3.0
    )
    plt.close(practice_runs.plot_largest({"a": 1, "b": 2, "c": 3, "d": 4}, "1 MiB", {"x": 1e9, "y": 2e9}))


def test_the_moment_lessons_helpers_show_what_they_claim():
    decay = tuning_moments.decay_without_gradients(1e-4, 50)
    fp32 = decay["fp32"]
    # fp32 follows v <- 0.999 v from v0 / 4 (within fp32 rounding); the narrow ones keep their first value.
    assert fp32[-1] == pytest.approx(2.5e-5 * 0.999**50, rel=1e-5)
    assert decay["bf16"][-1] == decay["bf16"][0] and decay["int8"][-1] == decay["int8"][0]
    x = torch.randn(4 * 2048, generator=torch.Generator().manual_seed(0)) * 1e-3
    x[:2048] *= 1000
    errors = tuning_moments.round_trip_errors(x)
    assert errors["per block, small blocks"] < errors["small values' size"] / 100
    assert errors["per tensor, small blocks"] == pytest.approx(errors["small values' size"])
    plt.close(tuning_plots.moment_decay(decay))
