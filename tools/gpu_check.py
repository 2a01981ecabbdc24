"""`make gpu-check`: exercise the CUDA path once and print its figures; without CUDA, say so and exit 0.

Checks: device allocation through the accelerator, pinned vs pageable host<->device copy bandwidth, a copy on a
side stream ordered by an event, the real out-of-memory error under a budget, a few engine steps in real fp16,
ZeRO-3's freed-and-restored layers, CPU offload with pinned host buffers against the same run on the device, and
module 5's serial, overlapped and delayed steps (the overlapped one must give the serial weights bit for bit).
"""

from __future__ import annotations

import sys
import time

import torch


def _bandwidth_gbs(dst: torch.Tensor, src: torch.Tensor, repeats: int = 10) -> float:
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return src.numel() * src.element_size() * repeats / (time.perf_counter() - started) / 1e9


def copies(accel) -> None:
    """Pinned vs pageable bandwidth both ways, and a copy on a side stream ordered by its event."""
    numel = 256 * 2**20  # 512 MiB of fp16
    dev = accel.empty(numel, torch.float16, category="parameters")
    pinned = accel.host_empty(numel, torch.float16, pin=True)
    pageable = torch.empty(numel, dtype=torch.float16)
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        print(
            f"{name:>8}: H2D {_bandwidth_gbs(dev, host):6.1f} GB/s, D2H {_bandwidth_gbs(host, dev):6.1f} GB/s"
        )
    stream = accel.new_stream()
    dev.fill_(1.5)
    done = stream.submit(lambda: pinned.copy_(dev, non_blocking=True))
    done.wait()
    assert float(pinned[-1]) == 1.5, "the side-stream copy did not land before its event"
    print("stream + event: copy on a side stream completed and was ordered by its event")


def offload(accel, data) -> bool:
    """ZeRO-2 + CPU offload (pinned) and stage 3 + offload_param on a real GPU: states on the host, same losses."""
    from zero_offload import initialize
    from zero_offload.workloads import TinyGPT, lm_loss

    pinned = {"device": "cpu", "pin_memory": True}
    runs = {
        "stage 0": {"stage": 0},
        "stage 2 + offload": {"stage": 2, "offload_optimizer": pinned},
        "stage 3 + offload_param": {"stage": 3, "offload_optimizer": pinned, "offload_param": pinned},
    }
    losses, ok = {}, True
    for name, zero in runs.items():
        config = {"train_batch_size": 16, "fp16": {"enabled": True}, "zero_optimization": zero}
        engine = initialize(TinyGPT("small"), config, accelerator=accel)
        torch.cuda.synchronize()
        started = time.perf_counter()
        losses[name] = []
        for step in range(10):
            x, y = data.global_batch(step, 16)
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses[name].append(loss.item())
        torch.cuda.synchronize()
        ms = (time.perf_counter() - started) / 10 * 1000
        line = f"{name:<24} {ms:7.1f} ms/step, loss {losses[name][0]:.4f} -> {losses[name][-1]:.4f}"
        if zero.get("offload_optimizer"):
            states = engine.states
            on_host = not states.master.is_cuda and states.master.is_pinned() and not states.exp_avg.is_cuda
            moved = {k: v / 10 / engine.num_params for k, v in states.transfers.bytes.items()}
            line += f", host states pinned: {on_host}, PCIe bytes/param/step {moved}"
            ok &= on_host
        print(line)
    gap = max(abs(a - b) for a, b in zip(losses["stage 0"], losses["stage 2 + offload"], strict=True))
    print(f"largest loss gap, offload vs device: {gap:.2e} (fp16 rounding)")
    return ok and gap < 1e-2


def pipeline(accel, data) -> bool:
    """Module 5 on a real GPU: serial vs overlapped (CUDA copy stream, pinned slots) vs DPU, in fp16."""
    from zero_offload import initialize
    from zero_offload.workloads import TinyGPT, lm_loss

    schedules = {
        "serial": {},
        "overlapped": {"overlap_offload": True},
        "delayed (DPU)": {
            "overlap_offload": True,
            "delayed_param_update": {"enabled": True, "start_step": 3},
        },
    }
    weights = {}
    for name, extension in schedules.items():
        config = {"train_batch_size": 4, "fp16": {"enabled": True}, "zero_offload": extension,
                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                        "reduce_bucket_size": 2_000_000, "overlap_comm": True}}  # fmt: skip
        engine = initialize(TinyGPT("10m"), config, accelerator=accel)
        times = []
        for step in range(12):
            torch.cuda.synchronize()
            started = time.perf_counter()
            x, y = data.global_batch(step, 4)
            engine.backward(lm_loss(engine(x), y))
            engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        engine.synchronize()
        weights[name] = [p.detach().clone() for p in engine.model.parameters()]
        print(f"{name:<16} {sorted(times[4:])[4] * 1000:7.1f} ms/step (median of the last 8)")
    same = all(torch.equal(a, b) for a, b in zip(weights["serial"], weights["overlapped"], strict=True))
    print(f"overlapped weights equal the serial step's bit for bit: {same}")
    return same


def main() -> int:
    if not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA device visible to torch; nothing to check (the emulated device needs none)."
        )
        return 0
    from zero_offload import initialize
    from zero_offload.accelerator import get_accelerator
    from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss, load_corpus

    accel = get_accelerator()
    props = torch.cuda.get_device_properties(accel.device)
    print(f"device: {props.name}, {props.total_memory / 2**30:.1f} GiB, torch {torch.__version__}")

    copies(accel)
    torch.cuda.empty_cache()

    budgeted = get_accelerator(2**30)
    try:
        budgeted.empty(2 * 2**30, torch.uint8, category="optimizer_states")
        print("out-of-memory: NOT raised under a 1 GiB budget", file=sys.stderr)
        return 1
    except torch.OutOfMemoryError as err:
        print(f"out-of-memory under a 1 GiB budget, as expected:\n  {str(err).splitlines()[-1]}")
    torch.cuda.set_per_process_memory_fraction(1.0, budgeted.device)

    model = TinyGPT("small")
    engine = initialize(model, {"train_batch_size": 16, "fp16": {"enabled": True}}, accelerator=accel)
    data = ByteBatches(load_corpus(), model.cfg.seq_len)
    losses = []
    torch.cuda.synchronize()
    started = time.perf_counter()
    for step in range(20):
        x, y = data.global_batch(step, 16)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    torch.cuda.synchronize()
    print(
        f"engine, real fp16 on {accel.device}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{(time.perf_counter() - started) / 20 * 1000:.1f} ms/step, {engine.skipped_steps} skipped"
    )
    print(engine.memory_report())

    # ZeRO-3 on one GPU: layers gathered into freed-and-restored CUDA storage, released after use.
    model = TinyGPT("small")
    engine = initialize(
        model,
        {"train_batch_size": 16, "fp16": {"enabled": True}, "zero_optimization": {"stage": 3}},
        accelerator=accel,
    )
    for step in range(5):
        x, y = data.global_batch(step, 16)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    gathered = sum(unit.gathered for unit in engine.states.units)
    print(f"stage 3: {len(engine.states.units)} units, {gathered} still gathered after the step (want 0)")
    offloaded = offload(accel, data)
    overlapped = pipeline(accel, data)
    return 0 if gathered == 0 and offloaded and overlapped else 1


if __name__ == "__main__":
    sys.exit(main())
