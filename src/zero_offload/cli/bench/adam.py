"""Three `make bench` sections about the Adam kernel, reported as ratios within one run:

  adam_implementations()  one Adam step over fp32 parameters: naive, torch's foreach and fused, DeepSpeed's
                          CPU Adam where installed, ours per variant and thread count, and the memory floor;
  offload_update()        the whole offloaded update (fp16 gradients in, unscale, Adam, fp16 weights out):
                          torch's passes against our one pass;
  moment_precisions()     the offloaded update with the moments stored in fp32, bf16 and int8, 1 and 2 threads,
                          each against its own memory floor (the bytes of that precision's pass).

Both time their contenders in interleaved rounds (timing.py), so that a slow spell hits all alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from ...accelerator.host_allocator import pageable_empty
from ...basics.adam import Adam
from ...tuning.build import CPUAdamUnavailable
from ...tuning.cpu_adam import CPUAdam, cpu_adam_update, memory_floor, supported_variants
from ...tuning.cpuinfo import cpu_model
from ...tuning.state_precision import BLOCK, PRECISIONS, zeros_state
from ...tuning.variant_choice import fastest_variant
from .timing import interleaved_ms

BYTES_PER_PARAM = 28  # one Adam pass: w, m, v read and written (24) + the fp32 gradient read (4)
# Bytes a parameter of m and v together, as stored: int8 adds one fp32 scale per moment and block.
STATE_BYTES = {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 2 * 4 / BLOCK}


def pass_bytes(precision: str) -> float:
    """Bytes one offloaded Adam pass moves a parameter: w read and written (8), the fp16 gradient read and the
    fp16 weight written (4), the moments read and written in their precision (28 for fp32, 20 bf16, ~16 int8)."""
    return 12 + 2 * STATE_BYTES[precision]


def _deepspeed_adam(param):
    """DeepSpeed's own CPU Adam, when `deepspeed` is installed: a reference, never a dependency."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam([param], lr=1e-3, adamw_mode=False)


def adam_implementations(numel: int = 16_700_000, rounds: int = 7, threads: int = 2) -> dict:
    """One Adam step over `numel` fp32 parameters in one tensor: every implementation, ours per variant and
    thread count, and the memory floor (the same bytes with no arithmetic) at `threads` threads."""
    torch.set_num_threads(threads)
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    makers = {
        "naive (basics.Adam)": lambda p: Adam([p], lr=1e-3),
        "torch foreach": lambda p: torch.optim.Adam([p], lr=1e-3, foreach=True),
        "torch fused": lambda p: torch.optim.Adam([p], lr=1e-3, fused=True),
        "DeepSpeedCPUAdam": _deepspeed_adam,
    }
    for variant in _c_variants():
        for count in range(1, threads + 1):
            makers[f"ours {variant} x{count}"] = lambda p, v=variant, t=count: CPUAdam(
                [p], lr=1e-3, adamw=False, variant=v, threads=t
            )
    steps, skipped = {}, {}
    for name, make in makers.items():
        param = torch.zeros(numel, requires_grad=True)
        param.grad = grad
        try:
            steps[name] = make(param).step
        except Exception as err:  # noqa: BLE001 - an optional reference that cannot be built is reported, not fatal
            skipped[name] = f"{type(err).__name__}: {err}".splitlines()[0][:100]
    if _c_variants():
        scratch = [torch.zeros(numel) for _ in range(3)]
        steps["memory floor"] = lambda: memory_floor(
            scratch[0], grad, scratch[1], scratch[2], threads=threads
        )
    ms = interleaved_ms(steps, rounds, desc="Adam implementations")
    floor = ms.pop("memory floor", None)
    return {"numel": numel, "threads": threads, "median_ms": ms, "floor_ms": floor, "skipped": skipped}


def streaming_stores() -> bool:
    """Whether this CPU's memory floor can write with streaming stores (x86 with AVX2)."""
    tiny = torch.zeros(64)
    try:
        memory_floor(tiny.clone(), tiny.half(), tiny.clone(), tiny.clone(), out=tiny.half(), nontemporal=True)
    except ValueError:
        return False
    return True


def floor_stores(ms: dict, name: str) -> tuple[float | None, str | None]:
    """The floor out of one run's timings: the faster of `name` (plain stores) and `name` + ", streaming
    output" (the 16-bit output, which is only written, by streaming stores), and which of the two it was.
    Both entries leave `ms`."""
    plain, streaming = ms.pop(name, None), ms.pop(f"{name}, streaming output", None)
    if streaming is not None and (plain is None or streaming < plain):
        return streaming, "streaming"
    return plain, "plain" if plain is not None else None


def _c_variants() -> list[str]:
    try:
        return supported_variants()
    except CPUAdamUnavailable:
        return []


def offload_update(numel: int = 16_700_000, rounds: int = 7, threads: int = 2) -> dict:
    """The whole offloaded update: fp16 gradients in, the loss-scale factor applied, Adam, fp16 weights out.

    torch does it in passes (upcast, scale, fused Adam, downcast: about twice the 28 bytes a parameter of
    one pass); the C kernel reads and writes each element once.
    """
    torch.set_num_threads(threads)
    grad16 = torch.randn(numel, generator=torch.Generator().manual_seed(0)).half()
    out16 = torch.empty(numel, dtype=torch.float16)
    param = torch.zeros(numel, requires_grad=True)
    fused = torch.optim.Adam([param], lr=1e-3, fused=True)

    def torch_pipeline():
        param.grad = grad16.float().mul_(1 / 1024)
        fused.step()
        out16.copy_(param.detach())

    steps = {"torch: upcast, scale, fused Adam, downcast": torch_pipeline}
    if _c_variants():
        master, m, v = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
        scratch = [torch.zeros(numel) for _ in range(3)]
        counter = iter(range(1, 10**6))
        steps["ours, one pass"] = lambda: cpu_adam_update(
            master, grad16, m, v, step=next(counter), lr=1e-3, grad_scale=1 / 1024, out=out16, threads=threads
        )
        for streaming in (False, True) if streaming_stores() else (False,):
            name = "memory floor, streaming output" if streaming else "memory floor"
            steps[name] = lambda nt=streaming: memory_floor(
                *scratch[:1], grad16, *scratch[1:], out=out16, threads=threads, nontemporal=nt
            )
    ms = interleaved_ms(steps, rounds, desc="offloaded update")
    floor, stores = floor_stores(ms, "memory floor")
    return {"numel": numel, "threads": threads, "median_ms": ms, "floor_ms": floor, "floor_stores": stores}


def host_zeros(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed host array placed as the engine places its host states (accelerator/host_allocator.py: a large
    one on 2 MiB pages of its own, its start staggered), so that the moment-precision rows time that layout."""
    return pageable_empty(numel, dtype).zero_()


def host_state(numel: int, precision: str) -> dict[str, torch.Tensor]:
    """zeros_state(numel, precision), its arrays placed by host_zeros."""
    return {name: host_zeros(t.numel(), t.dtype) for name, t in zeros_state(numel, precision).items()}


def state_step(param, grad, state: dict, out, threads: int, variant: str, counter) -> Callable[[], None]:
    """A function doing the next Adam step of `param` and `state` (any precision of tuning/state_precision.py),
    its step numbers from `counter`, as the moment-precision rows (and tools/ab_cpu_adam.py) time it."""
    return lambda: cpu_adam_update(
        param, grad, state["exp_avg"], state["exp_avg_sq"], exp_avg_scale=state.get("exp_avg_scale"),
        exp_avg_sq_scale=state.get("exp_avg_sq_scale"), step=next(counter), lr=1e-3, out=out, threads=threads,
        variant=variant,
    )  # fmt: skip


def state_floor(param, grad, state: dict, out, threads: int, nontemporal: bool) -> Callable[[], None]:
    """A function moving state_step's bytes with no arithmetic: that precision's memory floor."""
    return lambda: memory_floor(
        param, grad, state["exp_avg"], state["exp_avg_sq"], exp_avg_scale=state.get("exp_avg_scale"),
        exp_avg_sq_scale=state.get("exp_avg_sq_scale"), out=out, threads=threads, nontemporal=nontemporal,
    )  # fmt: skip


def moment_precisions(numel: int = 16_700_000, rounds: int = 7, threads: int = 2) -> dict:
    """The offloaded update (fp16 gradients in, Adam, fp16 weights out) over `numel` fp32 weights with the
    moments stored in each precision of tuning/state_precision.py, by the variant "auto" runs, on 1 and on
    `threads` threads; and beside each, that precision's own memory floor: the same bytes moved with no
    arithmetic (28, 20 and about 16 a parameter). All interleaved in one run, so the ratios hold. Every array
    is placed as the engine places its host states (host_zeros)."""
    torch.set_num_threads(threads)
    grad = host_zeros(numel, torch.float16).copy_(
        torch.randn(numel, generator=torch.Generator().manual_seed(0))
    )
    counts = sorted({1, threads})
    steps, floors, variants = {}, {}, {}
    for precision in PRECISIONS if _c_variants() else ():
        out = host_zeros(numel, torch.float16)
        param, state, counter = host_zeros(numel), host_state(numel, precision), itertools.count(1)
        scratch, scratch_state = host_zeros(numel), host_state(numel, precision)
        for count in counts:
            variants[(precision, count)] = variant = fastest_variant(count, supported_variants(), precision)
            steps[(precision, count)] = state_step(param, grad, state, out, count, variant, counter)
            for streaming in (False, True) if streaming_stores() else (False,):
                name = f"{precision} x{count} floor" + (", streaming output" if streaming else "")
                floors[name] = state_floor(scratch, grad, scratch_state, out, count, streaming)
    named = {f"{p} x{t}": fn for (p, t), fn in steps.items()}
    named.update(floors)
    ms = interleaved_ms(named, rounds, desc="moment precisions")
    rows = []
    for p, t in steps:
        floor, stores = floor_stores(ms, f"{p} x{t} floor")
        rows.append({"precision": p, "threads": t, "variant": variants[(p, t)], "pass_bytes": pass_bytes(p),
                     "ms": ms[f"{p} x{t}"], "floor_ms": floor, "floor_stores": stores,
                     "fp32_ms": ms[f"fp32 x{t}"]})  # fmt: skip
    return {"numel": numel, "cpu": cpu_model(), "rows": rows, "state_bytes": STATE_BYTES}


# The moment-precision goals: each narrow step this much faster than the fp32 one, within 10% of its own floor.
SPEED_TARGETS = {"bf16": 1.3, "int8": 1.6}
FLOOR_TARGET = 0.9


def target_verdict(row: dict) -> tuple[float | None, str]:
    """(the share of its floor a narrow step must reach for its speed target in this run, "met" or "missed");
    (None, "-") for fp32. Both floors move with the machine's bandwidth, and not always in proportion to their
    bytes: where fp32's step / this floor falls below the target, even a step at its floor cannot meet it."""
    target = SPEED_TARGETS.get(row["precision"])
    if target is None:
        return None, "-"
    needs = target * row["floor_ms"] / row["fp32_ms"]
    met = row["fp32_ms"] / row["ms"] >= target and row["floor_ms"] / row["ms"] >= FLOOR_TARGET
    return needs, "met" if met else "missed"


def print_moment_precisions(result: dict) -> None:
    numel = result["numel"]
    print(
        f"\nOffloaded update over {numel:,} fp32 weights (fp16 gradients in, fp16 weights out), the moments "
        f"stored in fp32, bf16 or int8\nCPU: {result['cpu']}; each row by the variant the engine's default "
        '("fastest") chose for that precision and thread count'
    )
    if not result["rows"]:
        print("skipped: the C Adam cannot be built here")
        return
    print(
        f"{'moments, threads':<18}{'variant':>8}{'B/param':>8}{'ms':>8}{'GB/s':>7}{'floor ms':>10}{'stores':>11}"
        f"{'of floor':>10}{'vs fp32':>9}{'needs':>7}{'goal':>8}"
    )
    for row in result["rows"]:
        gbps = row["pass_bytes"] * numel / row["ms"] / 1e6
        needs, goal = target_verdict(row)
        print(
            f"{row['precision'] + ' x' + str(row['threads']):<18}{row['variant']:>8}{row['pass_bytes']:>8.2f}{row['ms']:>8.1f}"
            f"{gbps:>7.1f}{row['floor_ms']:>10.1f}{row['floor_stores']:>11}{row['floor_ms'] / row['ms']:>10.0%}"
            f"{row['fp32_ms'] / row['ms']:>8.2f}x{'-' if needs is None else f'{needs:.0%}':>7}{goal:>8}"
        )
    targets = ", ".join(f"{p} >= {t}x" for p, t in SPEED_TARGETS.items())
    print(
        "B/param: bytes a step moves a parameter; floor: the same bytes with no arithmetic (zo_memory_floor), "
        "the faster of plain stores\nand streaming stores for the fp16 output (stores); of floor: floor ms / ms; "
        "vs fp32: the fp32-moment step's ms / this one's,\nsame threads, same run "
        f"(targets: {targets}, each >= {FLOOR_TARGET:.0%} of its floor);\nneeds: the share of its floor the step "
        "must reach for its speed target in this run (target x floor ms / fp32 ms;\nover 100%: out of reach at "
        "this run's bandwidth); goal: both targets met"
    )


def print_adam_implementations(adam: dict) -> None:
    fused, floor, numel = adam["median_ms"]["torch fused"], adam["floor_ms"], adam["numel"]
    print(
        f"\nAdam step over {numel:,} fp32 parameters, {adam['threads']} threads (medians of interleaved rounds)"
    )
    print(f"{'implementation':<28}{'ms':>9}{'vs fused':>10}{'Mparam/s':>10}{'GB/s':>8}{'of floor':>10}")
    rows = dict(adam["median_ms"], **({"memory floor (no arithmetic)": floor} if floor else {}))
    for name, ms in rows.items():
        share = f"{floor / ms:>9.0%}" if floor else f"{'-':>9}"
        gbps = BYTES_PER_PARAM * numel / ms / 1e6
        print(f"{name:<28}{ms:>9.1f}{fused / ms:>9.2f}x{numel / ms / 1e3:>10.0f}{gbps:>8.1f} {share}")
    for name, why in adam["skipped"].items():
        print(f"{name:<28} skipped: {why}")
    ours = {
        n: ms
        for n, ms in adam["median_ms"].items()
        if n.startswith("ours") and n.endswith(f"x{adam['threads']}")
    }
    if ours and floor:
        best = min(ours, key=ours.get)
        print(
            f"best of ours ({best}): {fused / ours[best]:.2f}x torch fused (target >= 1.0x), "
            f"{floor / ours[best]:.0%} of the floor (target >= 90%)"
        )


def print_offload_update(update: dict) -> None:
    numel = update["numel"]
    print(f"\nOffloaded update over {numel:,} parameters (fp16 gradients in, scale, Adam, fp16 weights out)")
    baseline = update["median_ms"]["torch: upcast, scale, fused Adam, downcast"]
    for name, ms in update["median_ms"].items():
        print(f"{name:<44}{ms:>8.1f} ms{baseline / ms:>8.2f}x")
    if update["floor_ms"]:
        ours = update["median_ms"]["ours, one pass"]
        stores = (
            "the fp16 output by streaming stores"
            if update.get("floor_stores") == "streaming"
            else "plain stores"
        )
        print(
            f"{'memory floor (28 bytes a parameter)':<44}{update['floor_ms']:>8.1f} ms   ({stores}) one pass at "
            f"{update['floor_ms'] / ours:.0%} of it; {baseline / ours:.2f}x the torch pipeline (target >= 2.0x)"
        )
