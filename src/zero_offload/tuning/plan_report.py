"""What `zo plan` prints and draws: the machine and model, a table of every configuration, the
recommendation with its advice and config, and the predicted step time against the batch and the link.

The numbers come from perfmodel.py and advisor.py; this file only lays them out.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from ..units import format_gb as gb
from .advisor import Recommendation
from .perfmodel import Hardware, Plan, Workload, plan


# -- what `zo plan` prints ----------------------------------------------------------------------------------
def describe(hw: Hardware, wl: Workload) -> str:
    hidden, layers = wl.shape()
    recompute = ", activation checkpointing" if wl.recompute else ""
    cached = ""
    if hw.cpu_adam_cache_bytes and hw.cpu_adam_cached_params_per_s:
        cached = (
            f"; {hw.cpu_adam_cached_params_per_s / 1e9:.3g} on states still in the cache, which keeps "
            f"{hw.cpu_adam_cache_bytes / 2**20:.0f} MiB of them between steps"
        )
    sockets = per_socket = ""
    if hw.sockets > 1:
        spread = " (spread over them)" if hw.numa_spread and hw.gpus < hw.sockets else ""
        sockets = f" in {hw.sockets} sockets of {hw.host_memory_gb_per_s / hw.sockets:.3g}"
        per_socket = f", each rank its own socket's{spread}"
    return (
        f"{wl.params / 1e9:.3g}B parameters ({layers} layers x hidden {hidden}), {wl.precision}"
        f"{'' if wl.moments == 'fp32' else f' with {wl.moments} Adam moments on the host'}, batch "
        f"{wl.batch} x {wl.seq_len} tokens per GPU{recompute}\n"
        f"{hw.name}: {hw.gpus} GPU(s) of {gb(hw.gpu_memory)}, {hw.gpu_tflops:.4g} TFLOP/s x {hw.mfu:.0%} "
        f"MFU; host {gb(hw.host_memory)}, {hw.cpu_cores} cores, memory {hw.host_memory_gb_per_s:.3g} GB/s"
        f"{sockets}; device-host link ({hw.link_kind}) {hw.link_gb_per_s:.3g} GB/s a direction\n"
        f"CPU Adam: {hw.cpu_adam_params_per_s / 1e9:.3g} Gparam/s the host, shared by its ranks{per_socket}; "
        f"{hw.cpu_adam_thread_params_per_s / 1e9:.3g} a thread; a rank with {hw.cpu_adam_threads} thread(s) "
        f"reaches {hw.cpu_adam_rank_params_per_s() / 1e9:.3g}{cached}"
    )


def format_plans(plans: list[Plan]) -> str:
    """One row per configuration: bytes per GPU and for the whole host, fit, predicted step time."""
    rows = [
        f"{'configuration':<36}{'device':>10}{'host':>10}  {'fits':<15}{'serial s':>9}{'overlap s':>10}"
        f"  {'bottleneck':<11}{'PCIe/step':>10}"
    ]
    rows.append("-" * len(rows[0]))
    for p in plans:
        short = [
            tier
            for tier, over in (
                ("device", p.device_bytes > p.device_usable),
                ("host", p.host_bytes > p.host_usable),
            )
            if over
        ]
        fits = "no: " + "+".join(short) if short else "yes"
        rows.append(
            f"{p.label:<36}{gb(p.device_bytes):>10}{gb(p.host_bytes):>10}  {fits:<15}"
            f"{p.time.serial:>9.3g}{p.time.overlapped:>10.3g}  {p.time.bottleneck:<11}{gb(p.pcie_bytes):>10}"
        )
    rows.append(
        "device: model states + activations + buckets, per GPU; host: model states + staging, all ranks"
    )
    rows.append(
        "time: compute 6 x params x tokens FLOPs (8 with recomputation) + Adam + copies; serial adds "
        "them up, overlap is the busiest resource alone"
    )
    rows.append("stage 0 cannot offload (offloading partitions the optimizer); offload_param needs stage 3")
    return "\n".join(rows)


def format_layouts(rows: list[tuple]) -> str:
    """advisor.plan_layouts as a table: the fastest full-offload choice that fits for each (dp, tp, pp)."""
    head = (
        f"{'nodes':>5}{'GPUs':>5}{'dp':>4}{'tp':>4}{'pp':>4}{'micro':>6}  {'fastest that fits':<34}{'device':>9}"
        f"{'host':>10}{'serial s':>9}{'overlap s':>10}  {'bottleneck':<11}{'TP+PP s':>8}{'bubble s':>9}"
    )
    lines = ["Parallel layouts (rough: parallel.py), the same global batch each:", head, "-" * len(head)]
    for hw, layout, best, least in rows:
        start = f"{hw.nodes:>5}{hw.gpus * hw.nodes:>5}{layout.dp(hw):>4}{layout.tp:>4}{layout.pp:>4}{layout.micro:>6}  "
        if best is None:
            lines.append(f"{start}{'none fits (least: ' + least.label + ')':<34}{gb(least.device_bytes):>9}")
            continue
        t = best.time
        lines.append(
            f"{start}{best.label:<34}{gb(best.device_bytes):>9}{gb(best.host_bytes):>10}{t.serial:>9.3g}"
            f"{t.overlapped:>10.3g}  {t.bottleneck:<11}{t.model_parallel:>8.3g}{t.bubble:>9.3g}"
        )
    lines.append(
        "per GPU: the model / (tp x pp), ZeRO-sharded over dp; TP inside a host, DP across hosts at the "
        "inter-node GB/s; pp > 1: stage 0/1 only (DeepSpeed's pipeline engine); host: per host"
    )
    return "\n".join(lines)


def format_recommendation(rec: Recommendation) -> str:
    if rec.plan is None:
        return "\n".join(["Recommendation: none fits.", *(f"  - {r}" for r in rec.reasons)])
    lines = [f"Recommendation: {rec.plan.label}", *(f"  - {r}" for r in rec.reasons)]
    lines += [f"  {a.level}: [{a.rule}] {a.message}" for a in rec.advice]
    lines += ["Config (DeepSpeed JSON, with zero_offload's own keys):", json.dumps(rec.config, indent=2)]
    lines += [f"  not for DeepSpeed: {note}" for note in engine_only_keys(rec.config)]
    return "\n".join(lines)


def engine_only_keys(config: dict) -> list[str]:
    """What DeepSpeed would make of the keys of `config` that only this engine reads: a DeepSpeed user must
    know which lines to drop, and why, before handing the printed JSON to deepspeed.initialize."""
    notes = []
    zero = config.get("zero_optimization", {})
    if zero.get("offload_optimizer", {}).get("ratio", 1.0) < 1.0 and zero.get("stage") != 3:
        notes.append(
            f"zero_optimization.offload_optimizer.ratio at stage {zero.get('stage')}: DeepSpeed takes a partial "
            "optimizer offload only at stage 3 and refuses this config; to run it under DeepSpeed, drop ratio "
            "(the whole optimizer then goes to the host: check that it fits) or use stage 3"
        )
    if "zero_offload" in config:
        notes.append(
            "zero_offload: this engine's own section (its C Adam's threads); DeepSpeed does not read it"
        )
    return notes


# -- what `zo plan --plot` draws: compute grows with the batch, the CPU step and the copies do not ----------
PLOTTED = ((0, "none"), (2, "none"), (2, "optimizer"), (3, "optimizer+param"))


def _plot(path, xs, evaluate, *, xlabel: str, title: str) -> Path:
    from .. import plots  # its matplotlib set-up (the Agg backend) and save_figure

    fig, ax = plots.plt.subplots(figsize=(6.8, 4.2))
    for stage, offload in PLOTTED:
        chosen = [evaluate(x, stage, offload) for x in xs]  # a configuration that does not fit is not drawn
        serial = [p.time.serial if p.fits else math.nan for p in chosen]
        overlapped = [p.time.overlapped if p.fits else math.nan for p in chosen]
        line = ax.plot(xs, serial, marker="o", markersize=3, label=f"{chosen[0].label}, serial")[0]
        ax.plot(
            xs, overlapped, linestyle="--", color=line.get_color(), label=f"{chosen[0].label}, overlapped"
        )
    ax.set(xscale="log", xlabel=xlabel, ylabel="predicted step time (s)", title=title)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, title="drawn only where it fits", title_fontsize=7)
    return plots.save_figure(fig, path)


def save_plots(
    hw: Hardware, wl: Workload, out_dir, batches=(1, 2, 4, 8, 16, 32, 64), links=(4, 8, 16, 32, 64, 128)
) -> list[Path]:
    """Predicted step time against the batch size and against the link bandwidth (only where it fits)."""
    out, size = Path(out_dir), f"{wl.params / 1e9:.3g}B params on {hw.gpus} x {gb(hw.gpu_memory)}"
    return [
        _plot(
            out / "step_time_vs_batch.png",
            list(batches),
            lambda b, s, o: plan(hw, replace(wl, batch=b), s, o),
            xlabel="micro-batch per GPU (sequences)",
            title=f"{size}: batch",
        ),
        _plot(
            out / "step_time_vs_link.png",
            list(links),
            lambda g, s, o: plan(replace(hw, link_gb_per_s=g), wl, s, o),
            xlabel="device-host link bandwidth (GB/s)",
            title=f"{size}, batch {wl.batch}: link",
        ),
    ]
