"""The accelerator: the emulated device's books, its OOM error, streams and events; CUDA when present."""

from __future__ import annotations

import gc
import platform
import subprocess
import sys
import threading
import time

import pytest
import torch

import zero_offload as zo
from zero_offload.accelerator import DeviceOutOfMemoryError, EmulatedAccelerator, get_accelerator

MiB = 2**20


def test_allocations_are_charged_and_returned_when_the_memory_dies():
    accel = EmulatedAccelerator(capacity=10 * MiB)
    a = accel.empty(MiB // 4, torch.float32, category="parameters")  # 1 MiB
    view = a[10:20]
    assert accel.memory_stats().in_use == MiB
    assert accel.memory_stats().by_category["parameters"] == MiB
    assert accel.is_on_device(view) and not accel.is_on_device(torch.empty(4))
    del a
    gc.collect()
    assert accel.memory_stats().in_use == MiB, "a live view keeps the device memory alive"
    del view
    gc.collect()
    assert accel.memory_stats().in_use == 0 and accel.memory_stats().peak == MiB


def test_out_of_memory_reads_like_cuda_and_names_the_fix():
    accel = EmulatedAccelerator(capacity=3 * MiB)
    keep = accel.empty(2 * MiB, torch.uint8, category="parameters")
    with pytest.raises(DeviceOutOfMemoryError) as err:
        accel.empty(2 * MiB, torch.uint8, category="optimizer_states")
    message = str(err.value)
    for fragment in (
        "out of memory",
        "Tried to allocate 2.00 MiB",
        "Budget 3.00 MiB",
        "2.00 MiB already in use",
        "peak",
        "offload_optimizer",
    ):
        assert fragment in message
    assert isinstance(err.value, torch.OutOfMemoryError), "handlers written for CUDA must catch it too"
    assert accel.memory_stats().in_use == 2 * MiB, "a failed allocation must not be charged"
    del keep


def test_unknown_category_is_an_error():
    with pytest.raises(ValueError, match="category"):
        EmulatedAccelerator().empty(4, torch.float32, category="weights")


def test_saved_activations_are_charged_at_storage_precision_until_backward():
    accel = EmulatedAccelerator()
    w = accel.empty((256, 256), torch.float32, category="parameters").normal_().requires_grad_()
    x = torch.randn(64, 256, requires_grad=True)
    with accel.activations(torch.float16):
        y = torch.tanh(x @ w)  # saves x (param w is not charged again) and tanh's output
    charged = accel.memory_stats().by_category["activations"]
    assert charged == (64 * 256 * 2) * 2, "two fp32 activations charged as fp16"
    y.sum().backward()
    gc.collect()
    assert accel.memory_stats().by_category["activations"] == 0


def test_compute_copies_of_weights_are_not_charged():
    accel = EmulatedAccelerator()
    w16 = accel.empty((128, 128), torch.float16, category="parameters").normal_().requires_grad_()
    with accel.activations(torch.float16):
        w32 = w16.float()
        accel.mark_compute_copy(w32)
        y = torch.ones(4, 128) @ w32  # saves w32 for backward, as a GPU would save the fp16 weight itself
    # only the input is charged (as fp16); the fp32 copy of the weight is not
    assert accel.memory_stats().by_category["activations"] == 4 * 128 * 2
    y.sum().backward()
    assert w16.grad is not None and w16.grad.dtype == torch.float16


def test_activations_over_budget_raise_with_a_batch_size_hint():
    accel = EmulatedAccelerator(capacity=MiB)
    x = torch.randn(1024, 1024, requires_grad=True)
    with pytest.raises(DeviceOutOfMemoryError, match="train_micro_batch_size_per_gpu"):
        with accel.activations():
            torch.tanh(x)


def test_stream_runs_its_queue_in_order_on_another_thread():
    stream = EmulatedAccelerator().new_stream()
    order, threads = [], set()

    def work(i):
        time.sleep(0.01 * (3 - i))  # later items are quicker: order must come from the queue
        order.append(i)
        threads.add(threading.get_ident())

    events = [stream.submit(work, i) for i in range(3)]
    events[-1].wait()
    assert order == [0, 1, 2] and all(e.done() for e in events)
    assert threading.get_ident() not in threads


def test_wait_event_orders_work_across_streams():
    accel = EmulatedAccelerator()
    copy, compute = accel.new_stream(), accel.new_stream()
    buf = torch.zeros(1)
    copied = copy.submit(lambda: (time.sleep(0.05), buf.fill_(7.0)))
    compute.wait_event(copied)
    result = compute.submit(lambda: float(buf))
    assert result._future.result() == 7.0


def test_a_failure_on_a_stream_surfaces_at_wait():
    stream = EmulatedAccelerator().new_stream()

    def boom():
        raise RuntimeError("copy failed")

    event = stream.submit(boom)
    with pytest.raises(RuntimeError, match="copy failed"):
        event.wait()


def test_environment_selects_and_budgets_the_device(monkeypatch):
    monkeypatch.setenv("ZO_DEVICE", "cpu")
    monkeypatch.setenv("ZO_DEVICE_MEMORY", "64MiB")
    accel = get_accelerator()
    assert accel.name == "emulated" and accel.capacity == 64 * MiB
    assert get_accelerator("1GB").capacity == 10**9, "the config's budget wins over the environment"
    monkeypatch.setenv("ZO_DEVICE_MEMORY", "lots")
    with pytest.raises(ValueError, match="ZO_DEVICE_MEMORY"):
        get_accelerator()
    monkeypatch.setenv("ZO_DEVICE", "tpu")
    with pytest.raises(ValueError, match="ZO_DEVICE"):
        get_accelerator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_asking_for_cuda_without_it_says_so(monkeypatch):
    monkeypatch.setenv("ZO_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        get_accelerator()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_accelerator_streams_pinned_copies_and_stats(monkeypatch):
    monkeypatch.delenv("ZO_DEVICE", raising=False)
    monkeypatch.delenv("ZO_DEVICE_MEMORY", raising=False)
    accel = get_accelerator()
    assert accel.name == "cuda"
    dev = accel.zeros(1 << 20, torch.float16, category="parameters")
    host = accel.host_empty(1 << 20, torch.float16, pin=True)
    assert host.is_pinned() and accel.is_on_device(dev) and not accel.is_on_device(host)
    stream = accel.new_stream()
    dev.fill_(3.0)
    event = stream.submit(lambda: host.copy_(dev, non_blocking=True))
    event.wait()
    assert float(host[0]) == 3.0
    assert accel.memory_stats().in_use >= dev.numel() * 2


def test_free_and_restore_storage_keep_the_tensor_and_the_books():
    accel = EmulatedAccelerator(capacity=4 * MiB)
    full = accel.empty(MiB // 2, torch.float16, category="parameters")  # 1 MiB
    view = full[:16].view(4, 4)
    accel.free_storage(full)
    assert accel.memory_stats().in_use == 0 and full.untyped_storage().nbytes() == 0
    assert full.shape == (MiB // 2,), "the tensor object and its shape survive"
    accel.restore_storage(full)
    full.fill_(2.0)
    assert accel.memory_stats().in_use == MiB and accel.is_on_device(full)
    assert float(view.sum()) == 32.0, "views see the refilled storage"
    del full, view
    gc.collect()
    assert accel.memory_stats().in_use == 0, "released exactly once when the storage dies"
    with pytest.raises(ValueError, match="not allocated"):
        accel.free_storage(torch.empty(4))


def test_a_forward_without_backward_gives_its_activations_back():
    accel = EmulatedAccelerator()
    w = torch.randn(256, 256, requires_grad=True)
    with accel.activations():
        y = torch.tanh(torch.randn(64, 256) @ w)
    assert accel.memory_stats().by_category["activations"] > 0
    del y
    gc.collect()
    assert accel.memory_stats().by_category["activations"] == 0


# malloc 25 blocks of 4 MB, write them, free them all, twice; the second round's page faults are printed.
# Straight through libc, so no Python or torch object lands between the blocks and pins the heap's top.
_FREED_BLOCKS_SCRIPT = """
import ctypes, resource, sys
from zero_offload.accelerator import keep_freed_blocks
if sys.argv[1] == "keep":
    assert keep_freed_blocks()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 4 * 2**20
libc.free(libc.malloc(size))  # glibc's threshold moves past 4 MB on this free: the blocks come from the heap
def round_of_blocks():
    blocks = [libc.malloc(size) for _ in range(25)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
round_of_blocks()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_of_blocks()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_emulated_device_reuses_freed_blocks_instead_of_faulting_in_fresh_pages():
    def faults(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", _FREED_BLOCKS_SCRIPT, mode], capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr
        return int(run.stdout)

    # By default glibc hands the 100 MB freed at the top of the heap back to the kernel, and writing the next
    # round's blocks faults every 4 KiB page in again (25,600 pages). A GPU's caching allocator would not.
    assert faults("default") > 20_000
    assert faults("keep") < 1_000


def test_a_cuda_accelerator_without_a_budget_lifts_the_cap_an_earlier_one_set(monkeypatch):
    # The cap is per process: an engine made after one with a budget must not inherit it. No GPU needed, the
    # calls the accelerator makes into torch.cuda are recorded instead.
    from zero_offload.accelerator import CudaAccelerator

    caps = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: type("Props", (), {"total_memory": 8 << 30})()
    )
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: caps.append(f))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    CudaAccelerator(2 << 30)
    CudaAccelerator()
    assert caps == [0.25, 1.0]


def _fake_gpus(monkeypatch, count=4):
    """torch.cuda as `count` GPUs of 8 GiB; returns the calls made to set_device and to the cap."""
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: type("Props", (), {"total_memory": 8 << 30})()
    )
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: calls.append(("cap", f))
    )
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    return calls


def test_a_cuda_accelerator_takes_local_ranks_gpu_even_where_the_script_made_the_group(monkeypatch):
    from zero_offload.accelerator import CudaAccelerator

    calls = _fake_gpus(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "2")  # torchrun's third rank on this node; current_device() still says 0
    assert CudaAccelerator().device == torch.device("cuda", 2)
    assert ("set_device", 2) in calls
    monkeypatch.delenv("LOCAL_RANK")
    assert CudaAccelerator().device == torch.device("cuda", 0)  # no launcher: the current device


def test_a_second_budget_while_the_first_engines_accelerator_lives_is_refused(monkeypatch):
    from zero_offload.accelerator import CudaAccelerator

    calls = _fake_gpus(monkeypatch)
    first = CudaAccelerator(2 << 30, index=1)
    CudaAccelerator(2 << 30, index=1)  # the same budget: nothing changes for the first
    CudaAccelerator(4 << 30, index=0)  # another GPU has a cap of its own
    with pytest.raises(
        ValueError, match=r"cuda:1 is already capped at 2.00 GiB .* asks for the whole device"
    ):
        CudaAccelerator(index=1)
    assert [f for name, f in calls if name == "cap"] == [0.25, 0.25, 0.5]
    del first
    CudaAccelerator(index=1)  # its owner is gone: the cap is set afresh


def test_each_engine_reports_its_own_peak_on_a_shared_accelerator():
    accel = EmulatedAccelerator()
    big = accel.empty(1 << 20, torch.float32)  # 4 MiB from an earlier run on the same device
    del big
    engine = zo.initialize(torch.nn.Linear(4, 4), {"train_batch_size": 1}, accelerator=accel)
    assert engine.memory_report().device.peak < 1 << 20
    engine.close()
