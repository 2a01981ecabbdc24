"""Lesson 4, sections 5 to 7: partial offload measured, the calibrated model against it, and the advisor's rules."""

from __future__ import annotations

import statistics
import textwrap

from .. import initialize
from ..accelerator import EmulatedAccelerator
from ..tuning import advisor, perfmodel
from ..units import format_bytes, format_gb
from ..workloads import ByteBatches, TinyGPT, lm_loss


def partial_config(ratio: float | None, batch: int = 4) -> dict:
    """Stage 2, fp16, the C Adam on one thread; `ratio` of the optimizer states on the host (None: no offload)."""
    zero = {"stage": 2}
    if ratio is not None:
        zero["offload_optimizer"] = {"device": "cpu", "ratio": ratio}
    return {
        "train_batch_size": batch,
        "fp16": {"enabled": True, "initial_scale_power": 12},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "zero_offload": {"cpu_adam": {"impl": "simd", "threads": 1}},
    }


def partial_run(model: str, ratio: float | None, steps: int, corpus, batch: int = 4) -> dict:
    """Train TinyGPT(model) `steps` steps under partial_config(ratio): bytes per tier, PCIe, CPU Adam, losses."""
    engine = initialize(TinyGPT(model), partial_config(ratio, batch), accelerator=EmulatedAccelerator())
    data = ByteBatches(corpus, engine.model.cfg.seq_len)
    losses = []
    for step in range(steps):
        x, y = data.global_batch(step, batch)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report, states = engine.memory_report(), engine.states
    transfers = states.transfers  # None without offload: no link, no counters
    adam = [h["adam_seconds"] for h in engine.history[1:] if not h["overflow"]]  # step 0 touches fresh pages
    return dict(
        params=engine.num_params,
        device=report.measured.device,
        host=report.measured.host,
        staging=report.host_staging,
        host_fraction=getattr(states, "host_fraction", 0.0),
        host_units=getattr(states, "host_units", 0),
        units=len(states.units),
        pcie=0 if transfers is None else (transfers.bytes["d2h"] + transfers.bytes["h2d"]) / steps,
        adam_s=statistics.median(adam) if adam else 0.0,
        losses=losses,
    )


def format_partial(partial: dict, model: str, steps: int) -> str:
    """The bytes per tier, PCIe traffic and CPU Adam time of each ratio, and how far the losses moved."""
    lines = [
        f"TinyGPT('{model}'): {partial[1.0]['params']:,} parameters, fp16, stage 2, {steps} steps\n",
        f"{'offload ratio':<14}{'host units':>11}{'host share':>11}{'device':>11}{'host':>11}{'staging':>11}"
        f"{'PCIe/step':>11}{'CPU Adam ms':>13}",
    ]
    for ratio, r in partial.items():
        label = "none" if ratio is None else f"{ratio:g}"
        adam_cell = "-" if ratio is None else f"{r['adam_s'] * 1e3:.2f}"  # no offload: no CPU step at all
        lines.append(
            f"{label:<14}{r['host_units']:>5} of {r['units']:<4}{r['host_fraction']:>10.1%}"
            f"{format_bytes(r['device']):>11}{format_bytes(r['host']):>11}{format_bytes(r['staging']):>11}"
            f"{format_bytes(r['pcie']):>11}{adam_cell:>13}"
        )
    full = partial[1.0]["losses"]
    moved = [
        f"{'no offload' if ratio is None else f'ratio {ratio:g}'} "
        f"{max(abs(a - b) for a, b in zip(r['losses'], full, strict=True)):.1e}"
        for ratio, r in partial.items()
        if ratio != 1.0
    ]
    lines.append("\nmax |loss difference| from the full offload over the run: " + ", ".join(moved))
    return "\n".join(lines)


def format_calibration(hw, partial: dict) -> str:
    """The calibrated model's CPU step for each ratio of `partial` against the measured median adam_seconds."""
    lines = [
        hw.notes,
        f"CPU Adam: {hw.cpu_adam_params_per_s / 1e6:.0f} M params/s, {hw.cpu_adam_call_seconds * 1e6:.0f} us "
        f"a call; memory traffic {hw.host_memory_gb_per_s:.1f} GB/s; matmul {hw.gpu_tflops * 1e3:.0f} GFLOP/s\n",
        f"{'offload ratio':<14}{'host params':>12}{'calls':>7}{'predicted ms':>14}{'measured ms':>13}"
        f"{'measured/predicted':>20}",
    ]
    for ratio, r in partial.items():
        if ratio is None:
            continue
        host_params = r["host_fraction"] * r["params"]
        predicted = perfmodel.cpu_adam_seconds(hw, host_params, r["host_units"])
        lines.append(
            f"{ratio:<14g}{host_params:>12,.0f}{r['host_units']:>7}{predicted * 1e3:>14.2f}"
            f"{r['adam_s'] * 1e3:>13.2f}{r['adam_s'] / predicted:>20.2f}"
        )
    return "\n".join(lines)


def format_advice(title: str, hw, wl, stage: int, offload: str, rules=None) -> str:
    """The chosen configuration's predicted step and the advisor's messages (only `rules`, if given)."""
    chosen = perfmodel.plan(hw, wl, stage, offload)
    lines = [
        f"{title}\n  {wl.params / 1e9:g}B params, batch {wl.batch}, {hw.gpus} x {format_gb(hw.gpu_memory)}, "
        f"host {format_gb(hw.host_memory)}: {chosen.label}, predicted {chosen.time.serial:.3g} s a step"
    ]
    for advice in advisor.advise(hw, wl, chosen, perfmodel.plan_all(hw, wl)):
        if rules is None or advice.rule in rules:
            lines.append(
                textwrap.fill(
                    f"{advice.level}: [{advice.rule}] {advice.message}",
                    118,
                    initial_indent="  ",
                    subsequent_indent="      ",
                )
            )
    return "\n".join(lines) + "\n"
