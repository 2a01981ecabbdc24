"""The CUDA branches, checked on the CPU: torch.cuda's functions are replaced, and decisions are checked directly."""

from __future__ import annotations

import ctypes
import gc
from types import SimpleNamespace

import pytest
import torch

import zero_offload as zo
from zero_offload.accelerator import Accelerator, CudaAccelerator, EmulatedAccelerator, hinted_oom
from zero_offload.accelerator.host_allocator import (
    PAGE,
    REGISTER_FROM,
    PinPlan,
    locked_host_bytes,
    pinned_plan,
    plan_of,
)
from zero_offload.basics.memory import (
    MemoryLedger,
    MemoryReport,
    ModelStateBytes,
    held_bytes,
    pinned_block_bytes,
)
from zero_offload.engine.model_setup import resident_dtype
from zero_offload.implementation.host_buffers import HostBuffers
from zero_offload.implementation.transfers import host_buffer
from zero_offload.units import format_bytes

MiB = 2**20


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as a 1 GiB GPU that has allocated 3 MiB and reserved 8 MiB; records the calls made to it."""
    calls = []
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=2**30))
    monkeypatch.setattr(cuda, "set_per_process_memory_fraction", lambda f, d: calls.append(("fraction", f)))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset_peak", d)))
    monkeypatch.setattr(cuda, "memory_allocated", lambda d: 3 * MiB)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda d: 5 * MiB)
    monkeypatch.setattr(cuda, "memory_reserved", lambda d: 8 * MiB)
    return calls


def _cuda_oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")


# -- 6: buffers and frozen parameters on the device, in the right precision ---------------------------------------
def test_resident_dtype_on_a_gpu_is_the_training_precision():
    gpu = Accelerator()  # computes in the storage dtype, as CudaAccelerator does
    fp32, fp64 = torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    for storage in (torch.float16, torch.bfloat16):
        assert resident_dtype(fp32, gpu, storage, parameter=False) == storage
        assert resident_dtype(fp32, gpu, storage, parameter=True) == storage
        for other in (torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool)):
            assert resident_dtype(other, gpu, storage, parameter=False) == other.dtype
    # fp32 runs keep the model's own dtypes, as before.
    assert resident_dtype(fp64, gpu, torch.float32, parameter=False) == torch.float64


def test_resident_dtype_on_the_emulated_device_keeps_buffers_in_fp32():
    emulated = EmulatedAccelerator()
    fp32 = torch.zeros(2)
    assert resident_dtype(fp32, emulated, torch.float16, parameter=False) == torch.float32  # as before
    # Stored like the trained weights: the upcast hooks compute with it in fp32.
    assert resident_dtype(fp32, emulated, torch.float16, parameter=True) == torch.float16


class _PartlyFrozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(8, 1)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return self.head(torch.relu(self.frozen(x)) * self.scale)


def test_fp16_run_with_a_frozen_layer_and_buffers():
    torch.manual_seed(0)
    model = _PartlyFrozen()
    frozen_before = model.frozen.weight.detach().clone()
    accel = EmulatedAccelerator()
    config = {
        "train_batch_size": 4,
        "fp16": {"enabled": True},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    }
    engine = zo.initialize(model, config, accelerator=accel)
    trainable = 2 * sum(p.numel() for p in model.head.parameters())
    frozen = 2 * sum(p.numel() for p in model.frozen.parameters())
    assert engine.num_params == trainable // 2  # frozen weights are no model state
    assert model.frozen.weight.dtype == torch.float16 and accel.is_on_device(model.frozen.weight)
    assert accel.memory_stats().by_category["parameters"] >= trainable + frozen  # the device holds them
    assert model.scale.dtype == torch.float32 and model.steps.dtype == torch.long
    for _ in range(3):
        x = torch.randn(4, 8)
        engine.backward(torch.nn.functional.mse_loss(engine(x).float(), x.sum(1, keepdim=True)))
        engine.step()
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())
    assert torch.equal(model.frozen.weight, frozen_before.half())
    engine.close()


# -- 7: the out-of-memory hint on every CUDA allocation path ------------------------------------------------------
def test_stage3_gather_out_of_memory_names_the_fix(fake_cuda, monkeypatch):
    accel = CudaAccelerator(index=0)
    monkeypatch.setattr(torch.UntypedStorage, "resize_", _cuda_oom)
    with pytest.raises(torch.OutOfMemoryError) as err:
        accel.restore_storage(torch.zeros(4), "parameters")
    message = str(err.value)
    assert (
        "Tried to allocate 2.00 GiB" in message and "While allocating 16 B of gathered_parameters" in message
    )
    assert "stage3_prefetch_bucket_size" in message and "offload_param" in message
    assert f"The device holds {format_bytes(3 * MiB)}" in message  # fake_cuda's memory_allocated
    assert "Tried to allocate 2.00 GiB" in str(err.value.__cause__)  # torch's own error, chained


def test_device_allocation_out_of_memory_names_what_and_how_much(fake_cuda, monkeypatch):
    accel = CudaAccelerator(capacity=2**29, index=0)
    real_empty = torch.empty

    def empty(*args, device=None, **kwargs):
        if device is not None:
            _cuda_oom()
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(torch.OutOfMemoryError) as err:
        accel.empty((4, MiB), torch.float16, category="buckets")
    message = str(err.value)
    assert "While allocating 8.00 MiB of buckets" in message and "reduce_bucket_size" in message
    assert "budget 512.00 MiB" in message and "\n" not in message  # one paragraph
    assert type(err.value) is torch.OutOfMemoryError and err.value.__cause__ is not None


def test_activation_out_of_memory_names_the_fix_once(fake_cuda):
    accel = CudaAccelerator(index=0)
    with pytest.raises(torch.OutOfMemoryError) as err, accel.activations(torch.float16):
        _cuda_oom()
    assert "train_micro_batch_size_per_gpu" in str(err.value)
    # An allocation that named its own category keeps that hint, passing through the activations' wrapper.
    gradients = hinted_oom(torch.OutOfMemoryError("CUDA out of memory."), "gradients")
    with pytest.raises(torch.OutOfMemoryError) as err, accel.activations(torch.float16):
        raise gradients
    assert err.value is gradients and str(err.value).count("Hint:") == 1
    with accel.activations(torch.float16):  # no error: nothing to do
        pass


# The four places a run on the emulated device runs out, each with a budget just too small for it.
def _two_layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))


_FP16 = {
    "train_batch_size": 1,
    "fp16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
}


def _hinted(err, *knobs: str) -> str:
    message = str(err.value)
    assert isinstance(err.value, torch.OutOfMemoryError)
    # Raised again with the hint, of the original's type, chained to the original (the budget's bare text).
    assert type(err.value) is type(err.value.__cause__) and err.value.__cause__ is not err.value
    assert "Hint:" not in str(err.value.__cause__) and message.startswith(str(err.value.__cause__))
    assert message.count("Hint:") == 1 and "\n" not in message
    for knob in knobs:
        assert knob in message
    return message


def test_a_bucket_out_of_memory_in_backward_names_the_bucket_size():
    accel = EmulatedAccelerator()
    engine = zo.initialize(_two_layers(), {**_FP16, "zero_optimization": {"stage": 2}}, accelerator=accel)
    loss = engine(torch.ones(1, 256)).float().sum()
    accel.capacity = accel.memory_stats().in_use  # full: the first gradient bucket does not fit
    with pytest.raises(torch.OutOfMemoryError) as err:
        engine.backward(loss)
    message = _hinted(err, "reduce_bucket_size", "for buckets")
    assert "train_micro_batch_size_per_gpu" not in message  # backward's own hint did not wrap it again
    engine.close()


def test_a_stage3_gather_out_of_memory_names_the_prefetch_size():
    accel = EmulatedAccelerator()
    engine = zo.initialize(_two_layers(), {**_FP16, "zero_optimization": {"stage": 3}}, accelerator=accel)
    accel.capacity = accel.memory_stats().in_use
    with pytest.raises(torch.OutOfMemoryError) as err:
        engine(torch.ones(1, 256))
    _hinted(err, "stage3_prefetch_bucket_size", "offload_param", "gathered_parameters")
    engine.close()


def test_a_master_weight_out_of_memory_names_the_optimizer_offload():
    weights = 2 * sum(p.numel() for p in _two_layers().parameters())
    # Room for the fp16 weights and gradients, not for the fp32 master weights.
    accel = EmulatedAccelerator(capacity=2 * weights + 1024)
    with pytest.raises(torch.OutOfMemoryError) as err:
        zo.initialize(_two_layers(), _FP16, accelerator=accel)
    _hinted(err, "master_weights", '"offload_optimizer": {"device": "cpu"}')


def test_a_forward_out_of_memory_names_the_micro_batch_and_checkpointing():
    accel = EmulatedAccelerator()
    engine = zo.initialize(_two_layers(), _FP16, accelerator=accel)
    accel.capacity = accel.memory_stats().in_use  # the model states fill it: no room for an activation
    with pytest.raises(torch.OutOfMemoryError) as err:
        engine(torch.ones(1, 256))
    _hinted(err, "for activations", "train_micro_batch_size_per_gpu", "activation_checkpointing")
    engine.close()


def test_an_out_of_memory_in_adams_own_temporaries_names_the_optimizer_offload(monkeypatch):
    # A fixed loss scale: the step must run, not be skipped for an overflow.
    config = {**_FP16, "fp16": {"enabled": True, "loss_scale": 1.0}}
    engine = zo.initialize(_two_layers(), config, accelerator=EmulatedAccelerator())
    engine.backward(engine(torch.ones(1, 256)).float().sum())

    def runs_out(*args, **kwargs):  # as torch's fused Adam does when its intermediate buffers do not fit
        _cuda_oom()

    monkeypatch.setattr(engine.optimizer, "step", runs_out)
    with pytest.raises(torch.OutOfMemoryError) as err:
        engine.step()
    message = _hinted(err, "While allocating the optimizer step", '"offload_optimizer": {"device": "cpu"}')
    assert "train_micro_batch_size_per_gpu" not in message
    engine.close()


class _RunsOutInBackward(torch.autograd.Function):
    """Identity forward; its backward fails the way CUDA does when autograd's own buffers do not fit."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _cuda_oom()


def test_backward_out_of_memory_names_the_fix():
    model = torch.nn.Linear(4, 4)
    engine = zo.initialize(model, {"train_batch_size": 1}, accelerator=EmulatedAccelerator())
    loss = _RunsOutInBackward.apply(engine(torch.ones(1, 4))).sum()
    with pytest.raises(torch.OutOfMemoryError) as err:
        engine.backward(loss)
    assert "Tried to allocate 2.00 GiB" in str(err.value)
    assert "activation_checkpointing" in str(err.value) and "train_micro_batch_size_per_gpu" in str(err.value)
    engine.close()


# -- 8: the peak belongs to this engine; reserved memory is shown --------------------------------------------------
def test_cuda_accelerator_resets_the_peak_and_reports_reserved(fake_cuda):
    accel = CudaAccelerator(capacity=2**29, index=0)
    assert ("fraction", 0.5) in fake_cuda and ("reset_peak", torch.device("cuda", 0)) in fake_cuda
    stats = accel.memory_stats()
    assert (stats.in_use, stats.peak, stats.reserved) == (3 * MiB, 5 * MiB, 8 * MiB)
    report = MemoryReport(ModelStateBytes(), ModelStateBytes(), stats, "cuda", 0)
    assert f"reserved {format_bytes(8 * MiB)}" in str(report)


def test_emulated_device_reserves_what_it_uses():
    accel = EmulatedAccelerator()
    keep = accel.empty(MiB, torch.uint8, category="other")
    stats = accel.memory_stats()
    assert stats.reserved == stats.in_use == MiB
    assert "reserved" in str(MemoryReport(ModelStateBytes(), ModelStateBytes(), stats, "emulated", 0))
    del keep


# -- 9: pinned host memory counted as the allocator holds it ------------------------------------------------------
def test_pinned_blocks_round_up_to_a_power_of_two():
    assert [pinned_block_bytes(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096, 8192]
    assert pinned_block_bytes(300 * MiB) == 512 * MiB


def test_ledger_and_staging_count_pinned_buffers_rounded(monkeypatch):
    pageable = torch.empty(300)  # 1200 bytes
    assert held_bytes(pageable) == 1200
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    assert held_bytes(pageable) == 2048
    ledger = MemoryLedger(device="meta")
    ledger.record("exp_avg", pageable)
    assert ledger.measure().host == 2048
    flat = torch.empty(300, dtype=torch.float16)  # 600 bytes, two views of one pinned block
    buffers = SimpleNamespace(
        grad_staging=[flat[:100], flat[100:]],
        separate_param_staging=True,
        param_staging=[torch.empty(50, dtype=torch.float16)],  # 100 bytes
    )
    assert HostBuffers.host_staging_bytes(buffers) == 1024 + 128


# -- N6: a pinned buffer locks about its own size, not the next power of two ---------------------------------------
def test_a_large_pinned_buffer_locks_its_size_not_the_next_power_of_two():
    request = 4_400_000_000  # a 1.1B-parameter fp32 flat buffer
    assert pinned_block_bytes(request) == 8 * 2**30  # what torch's caching allocator would lock
    plan = pinned_plan(request)
    assert plan.method == "register" and plan.requested == request
    assert request <= plan.locked_bytes < request + PAGE and plan.locked_bytes % PAGE == 0


def test_small_pinned_buffers_keep_the_caching_allocator_which_wastes_less_than_their_size():
    assert pinned_plan(1000) == PinPlan("caching", 1000, 1024)
    largest_cached = pinned_plan(REGISTER_FROM - 1)
    assert largest_cached.method == "caching" and largest_cached.locked_bytes == REGISTER_FROM
    assert pinned_plan(REGISTER_FROM).method == "register"
    assert pinned_plan(0).locked_bytes == 0
    with pytest.raises(ValueError):
        pinned_plan(-1)


class _FakeCudart:
    """torch.cuda.cudart()'s page-locking calls, recorded; `fail` makes cudaHostRegister fail as at ulimit -l."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def cudaHostRegister(self, address, nbytes, flags):
        self.calls.append(("register", address, nbytes))
        return 2 if self.fail else 0  # cudaErrorMemoryAllocation

    def cudaHostUnregister(self, address):
        ctypes.string_at(address, 1)  # the pages must still be mapped when they are unlocked
        self.calls.append(("unregister", address))
        return 0

    def cudaGetErrorString(self, code):
        return "out of memory"


def test_a_large_buffer_on_a_gpu_is_locked_in_place_and_unlocked_when_its_last_view_dies(
    fake_cuda, monkeypatch
):
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    accel = CudaAccelerator(index=0)
    locked_before = locked_host_bytes()
    numel = REGISTER_FROM // 2 + 3  # fp16: just over REGISTER_FROM bytes, not a whole number of pages
    buffer = host_buffer(accel, numel, torch.float16, pin=True)
    ((call, address, nbytes),) = cudart.calls
    assert (call, address, nbytes) == ("register", buffer.data_ptr(), 2 * numel) and address % PAGE == 0
    assert plan_of(buffer) == pinned_plan(2 * numel) and plan_of(buffer).method == "register"
    assert held_bytes(buffer) == pinned_plan(2 * numel).locked_bytes < 2 * numel + PAGE
    assert locked_host_bytes() - locked_before == held_bytes(buffer)
    assert buffer.shape == (numel,) and not buffer.any()  # zeroed, as host_buffer promises
    view = buffer[10:20]
    del buffer
    gc.collect()
    assert len(cudart.calls) == 1, "a live view keeps the pages locked"
    del view
    gc.collect()
    assert cudart.calls[-1] == ("unregister", address)
    assert locked_host_bytes() == locked_before


def test_a_gpu_buffer_that_cannot_be_locked_falls_back_to_pageable_memory(fake_cuda, monkeypatch):
    from zero_offload.accelerator import cuda

    cudart, taken = _FakeCudart(fail=True), []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(cuda, "_take_last_error", taken.append)
    accel = CudaAccelerator(index=0)
    with pytest.warns(UserWarning, match="could not pin host memory.*cudaHostRegister.*out of memory"):
        buffer = host_buffer(accel, REGISTER_FROM, torch.uint8, pin=True)
    assert [c[0] for c in cudart.calls] == ["register"]  # nothing locked, so nothing to unlock
    assert taken == [accel.device]  # CUDA's last error was cleared
    assert plan_of(buffer) is None and held_bytes(buffer) == REGISTER_FROM and buffer.numel() == REGISTER_FROM


def test_the_emulated_device_counts_the_bytes_a_gpu_would_lock():
    accel = EmulatedAccelerator()
    large = host_buffer(accel, REGISTER_FROM + 1, torch.uint8, pin=True)
    small = host_buffer(accel, 3000, torch.uint8, pin=True)
    pageable = host_buffer(accel, 3000, torch.uint8, pin=False)
    assert accel.is_pinned(large) and not large.is_pinned()  # asked for as pinned; nothing is really locked
    assert held_bytes(large) == pinned_plan(REGISTER_FROM + 1).locked_bytes == REGISTER_FROM + PAGE
    assert held_bytes(small) == 4096 and held_bytes(pageable) == 3000
    ledger = MemoryLedger(accel)
    ledger.record("exp_avg", [large, small, pageable])
    assert ledger.measure().host == REGISTER_FROM + PAGE + 4096 + 3000


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: page-locks 1.5 GiB of host memory"
)
def test_a_1_5_gib_pinned_buffer_locks_under_1_6_gib_on_a_gpu(monkeypatch):
    monkeypatch.delenv("ZO_DEVICE", raising=False)
    monkeypatch.delenv("ZO_DEVICE_MEMORY", raising=False)
    accel = CudaAccelerator()
    stats = getattr(torch.cuda, "host_memory_stats", dict)
    cached_before = stats().get("allocated_bytes.current", 0)
    locked_before = locked_host_bytes()
    buffer = host_buffer(accel, 3 * 2**29, torch.uint8, pin=True)
    assert buffer.is_pinned() and plan_of(buffer).method == "register"
    assert locked_host_bytes() - locked_before == held_bytes(buffer) < 1.6 * 2**30
    # The caching allocator holds none of it (through it, the buffer would take a 2 GiB block).
    assert stats().get("allocated_bytes.current", 0) - cached_before < 1.6 * 2**30
    buffer[-1] = 7
    device = accel.empty(buffer.numel(), torch.uint8, category="other")
    accel.copy_(device, buffer, non_blocking=True)
    torch.cuda.synchronize()
    assert int(device[-1]) == 7
    # Locking the same pages twice fails: the error comes back as a RuntimeError, and CUDA's last error is
    # cleared, so the next kernel does not fail in its place.
    with pytest.raises(RuntimeError, match="cudaHostRegister"):
        accel._register(buffer.data_ptr(), PAGE)
    assert float(torch.ones(4, device=accel.device).sum()) == 4.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_real_cuda_out_of_memory_is_hinted_and_chained(monkeypatch):
    monkeypatch.delenv("ZO_DEVICE_MEMORY", raising=False)
    accel = CudaAccelerator()
    with pytest.raises(torch.OutOfMemoryError) as err:
        accel.empty(2**50, torch.uint8, category="buckets")  # 1 PiB
    assert "reduce_bucket_size" in str(err.value) and "1024.00 TiB of buckets" in str(err.value)
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError) and "Hint:" not in str(err.value.__cause__)


def test_the_pipelines_staging_slots_are_pinned_even_with_pin_memory_false():
    config = {"train_batch_size": 2, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
              "zero_offload": {"overlap_offload": True}}  # fmt: skip
    accel = EmulatedAccelerator()
    engine = zo.initialize(torch.nn.Linear(8, 8), config, accelerator=accel)
    pipeline = engine.optimizer_step.pipeline
    slots = pipeline.grad_slots.buffers + pipeline.weight_slots.buffers
    assert slots and all(accel.is_pinned(slot) for slot in slots)
    assert not accel.is_pinned(engine.states.master)  # the large buffers follow pin_memory
    engine.close()


def test_pageable_buffers_the_pipeline_copies_directly_are_named_on_a_gpu():
    from zero_offload.practice.pipeline import warn_pageable_copies

    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    fp32 = SimpleNamespace(pin_optimizer=False, dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"fp32 master weights.*\"pin_memory\": true"):
        warn_pageable_copies(fp32, gpu, keep_gradients=False)
    with pytest.warns(UserWarning, match=r"delayed update's gradient areas"):
        warn_pageable_copies(
            SimpleNamespace(pin_optimizer=False, dtype=torch.bfloat16), gpu, keep_gradients=True
        )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_pageable_copies(
            SimpleNamespace(pin_optimizer=False, dtype=torch.bfloat16), gpu, keep_gradients=False
        )
        warn_pageable_copies(fp32, SimpleNamespace(device=torch.device("cpu")), keep_gradients=False)


class _RecordingDevice(EmulatedAccelerator):
    """The emulated device, recording on which stream each upload to the device was queued."""

    def __init__(self):
        super().__init__()
        self.on_stream, self.uploads, self.compute_waited = None, [], 0

    def issuing_on(self, stream):
        device = self

        class Issuing:
            def __enter__(self):
                device.on_stream = stream.name

            def __exit__(self, *exc):
                device.on_stream = None

        return Issuing()

    def copy_(self, dst, src, *, non_blocking=False):
        if self.is_on_device(dst) and not self.is_on_device(src):
            self.uploads.append(self.on_stream)
        super().copy_(dst, src, non_blocking=non_blocking)

    def compute_waits(self, event):
        self.compute_waited += 1
        super().compute_waits(event)


def test_stage3_parameter_uploads_queue_on_their_own_stream_and_compute_waits_for_them():
    cpu = {"device": "cpu"}
    config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "offload_optimizer": cpu, "offload_param": cpu}}  # fmt: skip
    accel = _RecordingDevice()
    engine = zo.initialize(
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)), config, accelerator=accel
    )
    accel.uploads.clear()
    engine.backward(engine(torch.ones(2, 8)).sum())
    gathers = len(accel.uploads)
    assert gathers >= 4 and set(accel.uploads) == {"zo-param-h2d"}  # forward and backward, each layer
    assert accel.compute_waited >= gathers  # every reader of a gathered unit waited for its upload
    engine.close()
