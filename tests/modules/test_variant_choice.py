"""`"variant": "fastest"`: the C Adam's loop chosen by measurement, once per machine, the same in every process.

The timings here are made up (an injected `measure`): what is tested is the choice and its cache, never a speed.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

from zero_offload.tuning import variant_choice
from zero_offload.tuning.variant_choice import CACHE_FILE, cached_choices, choice_key, fastest_variant

VARIANTS = ["scalar", "avx2", "avx512"]


class Timings:
    """A measure() that returns the given milliseconds and counts its calls."""

    def __init__(self, ms: dict[str, float]):
        self.ms, self.calls = ms, 0

    def __call__(self, variants, threads, precision):
        self.calls += 1
        return {v: self.ms[v] for v in variants}


@pytest.fixture(autouse=True)
def fixed_key(monkeypatch):
    # The key names the kernel's build: no compiler needed for these tests.
    monkeypatch.setattr(
        variant_choice,
        "choice_key",
        lambda threads, precision="fp32": f"this CPU | {threads} thread(s) | {precision}",
    )


def test_the_fastest_variant_is_chosen_even_when_it_is_not_the_widest(tmp_path):
    measure = Timings({"scalar": 30.0, "avx2": 7.2, "avx512": 10.6})  # the Zen 5 VM's shape
    assert fastest_variant(1, VARIANTS, measure=measure, directory=tmp_path) == "avx2"
    # Measured once: the next engine, in this process or another, reads the answer.
    assert fastest_variant(1, VARIANTS, measure=measure, directory=tmp_path) == "avx2"
    assert measure.calls == 1
    entry = cached_choices(tmp_path)["this CPU | 1 thread(s) | fp32"]
    assert entry == {"variant": "avx2", "ms": {"scalar": 30.0, "avx2": 7.2, "avx512": 10.6}}


def test_each_thread_count_is_measured_for_itself(tmp_path):
    one, two = Timings({"avx2": 7.0, "avx512": 9.0}), Timings({"avx2": 5.0, "avx512": 4.0})
    assert fastest_variant(1, ["avx2", "avx512"], measure=one, directory=tmp_path) == "avx2"
    assert fastest_variant(2, ["avx2", "avx512"], measure=two, directory=tmp_path) == "avx512"
    assert one.calls == two.calls == 1 and len(cached_choices(tmp_path)) == 2


def test_each_precision_of_the_moments_is_measured_for_itself(tmp_path):
    # The Xeon's shape: with int8 moments the 512-bit loop wins, with bf16 and fp32 the 256-bit one.
    shapes = {"fp32": {"avx2": 13.7, "avx512": 14.4}, "bf16": {"avx2": 12.4, "avx512": 13.2},
              "int8": {"avx2": 13.1, "avx512": 11.7}}  # fmt: skip
    asked = []

    def measure(variants, threads, precision):
        asked.append(precision)
        return shapes[precision]

    chosen = {
        p: fastest_variant(2, ["avx2", "avx512"], p, measure=measure, directory=tmp_path) for p in shapes
    }
    assert chosen == {"fp32": "avx2", "bf16": "avx2", "int8": "avx512"}
    assert asked == ["fp32", "bf16", "int8"]
    assert fastest_variant(2, ["avx2", "avx512"], "int8", measure=measure, directory=tmp_path) == "avx512"
    assert len(asked) == 3  # read back, not measured again


@pytest.mark.parametrize(
    "damage", ["{not json", "[1, 2]", '{"this CPU | 1 thread(s) | fp32": {"variant": "avx512"}}']
)
def test_a_damaged_cache_or_a_variant_this_cpu_lacks_is_measured_again(tmp_path, damage):
    (tmp_path / CACHE_FILE).write_text(damage)
    measure = Timings({"scalar": 9.0, "avx2": 3.0})
    assert fastest_variant(1, ["scalar", "avx2"], measure=measure, directory=tmp_path) == "avx2"
    assert (
        measure.calls == 1 and cached_choices(tmp_path)["this CPU | 1 thread(s) | fp32"]["variant"] == "avx2"
    )


def test_a_cache_directory_that_cannot_be_written_costs_a_measurement_not_an_error(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a file where the directory should be: nothing can be created under it
    measure = Timings({"scalar": 9.0, "avx2": 3.0})
    assert fastest_variant(1, ["scalar", "avx2"], measure=measure, directory=blocked) == "avx2"
    assert fastest_variant(1, ["scalar", "avx2"], measure=measure, directory=blocked) == "avx2"
    assert measure.calls == 2


def _slow_measure(variants, threads, log):
    with open(log, "a") as file:
        file.write("measured\n")
    time.sleep(0.5)  # long enough for the other process to arrive while this one holds the lock
    return {"avx2": 1.0, "avx512": 2.0}


def _choose(directory, log, queue):
    variant_choice.choice_key = lambda threads, precision="fp32": "this CPU"
    queue.put(
        fastest_variant(
            1, ["avx2", "avx512"], measure=lambda v, t, p: _slow_measure(v, t, log), directory=directory
        )
    )


def test_two_processes_starting_together_measure_once_and_agree(tmp_path):
    """The second process arrives while the first measures: it waits for the answer instead of measuring too
    (two measurements at once would each see half the bandwidth, and could choose differently)."""
    log, context = tmp_path / "log", multiprocessing.get_context("fork")
    queue = context.Queue()
    first = context.Process(target=_choose, args=(tmp_path, log, queue))
    first.start()
    while not log.exists():  # the first holds the lock, mid-measurement
        time.sleep(0.01)
    second = context.Process(target=_choose, args=(tmp_path, log, queue))
    second.start()
    first.join(10)
    second.join(10)
    assert [queue.get(timeout=5), queue.get(timeout=5)] == ["avx2", "avx2"]
    assert log.read_text() == "measured\n"


def test_the_key_names_the_cpu_the_kernel_build_the_threads_and_the_sample(monkeypatch):
    monkeypatch.undo()  # the real key
    pytest.importorskip("cffi")
    try:
        key, narrow = choice_key(2), choice_key(2, "int8")
    except Exception as err:  # no compiler: the kernel has no build to name
        pytest.skip(f"the C Adam cannot be built here: {err}")
    sample = f"sample {variant_choice.sample_size():,}"
    assert "zo_cpu_adam_" in key and key.endswith(f"2 thread(s) | fp32 moments | {sample}")
    assert narrow.endswith(f"2 thread(s) | int8 moments | {sample}")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_the_real_measurement_runs_every_variant_on_that_precision(monkeypatch, precision):
    monkeypatch.undo()
    pytest.importorskip("cffi")
    from zero_offload.tuning.cpu_adam import supported_variants

    try:
        variants = supported_variants()
    except Exception as err:
        pytest.skip(f"the C Adam cannot be built here: {err}")
    monkeypatch.setattr(variant_choice, "sample_size", lambda: 1 << 14)
    timings = variant_choice.time_variants(variants, 1, precision)
    assert set(timings) == set(variants) and all(ms > 0 for ms in timings.values())


def test_the_sample_fills_twice_the_last_level_cache_within_bounds():
    assert variant_choice.sample_size(0) == variant_choice.SAMPLE  # no cache reported: the smallest
    assert variant_choice.sample_size(32 * 2**20) == variant_choice.SAMPLE  # 4M x 16 B = 64 MiB = 2 x 32 MiB
    assert variant_choice.sample_size(64 * 2**20) == 8 * 2**20
    assert variant_choice.sample_size(300 * 2**20) == variant_choice.LARGEST_SAMPLE
