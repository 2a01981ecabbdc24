"""The demo's report: out/demo/report.md, the numbers of each part with its plots, readable on GitHub or in VS Code."""

from __future__ import annotations

from pathlib import Path

from ...units import format_bytes, format_gb
from .explain import explain_schedules
from .parts import host_capacity_line


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _image(out: Path, name: str, alt: str) -> list[str]:
    return [f"![{alt}]({name})", ""] if (out / name).exists() else []


def write_report(out: Path, results: dict) -> Path:
    arithmetic, offload, memory = results["arithmetic"], results["offload"], results["memory"]
    lines = [
        "# zero-offload demo report",
        "",
        "GPU computes, CPU stores, PCIe moves (GPU 算、CPU 存、PCIe 传). Every number below was measured on "
        "this machine by `make demo`, except part 0's arithmetic.",
        "",
        "## 0. The arithmetic of a 13B model (fp16 Adam, per GPU)",
        "",
    ]
    lines += _table(
        ["configuration", "device", "host"],
        [[k, format_gb(v["device"]), format_gb(v["host"])] for k, v in arithmetic["estimates"].items()],
    )
    lines += [
        "",
        "The course introduction counts 12 bytes a parameter; with the fp32 master weights it is 16.",
        "Its example config pairs `offload_param` with stage 2, which is refused:",
        "",
        "```",
        arithmetic["introduction"],
        "```",
        "",
    ] + _image(out, "memory_13b.png", "13B model states")
    lines += ["## 1. Stage 0 runs out of device memory", "", "```", results["out_of_memory"], "```", ""]
    losses = offload["losses"]
    lines += [
        "## 2. ZeRO-2 + CPU offload fits the same budget",
        "",
        f"{offload['params']:,} parameters on {offload['ranks']} rank(s) on {offload['nodes']} node(s), "
        f"{offload['steps']} steps: loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f}; device peak {format_bytes(offload['device_peak'])} of "
        f"{format_bytes(offload['budget'])}; PCIe per step and rank "
        f"{format_bytes(offload['pcie_bytes_per_step']['d2h'])} down, "
        f"{format_bytes(offload['pcie_bytes_per_step']['h2d'])} up.",
        "",
    ] + _image(out, "loss.png", "loss")
    lines += ["## 3. Serial vs overlapped vs delayed (DPU) offload", ""]
    for cores, r in results.get("schedules", {}).items():
        lines += [
            f"**{cores} cores** ({r['params'] / 1e6:.1f}M parameters, batch {r['batch']} x {r['seq_len']} "
            "tokens, median ms per step):",
            "",
        ]
        lines += _table(list(r["median_ms"]), [[f"{v:.0f}" for v in r["median_ms"].values()]])
        lines += [
            "",
            f"Overlapped / serial: {r['overlapped_vs_serial']:.2f}x; DPU / overlapped: "
            f"{r['delayed_vs_overlapped']:.2f}x.",
            "",
            *(f"- {sentence}" for sentence in explain_schedules(r)),
            "",
        ]
        for slug in ("serial", "overlapped", "delayed"):
            lines += _image(out, f"timeline_{slug}_{cores}.png", f"{slug} timeline, {cores} cores")
    lines += ["## 4. Memory per tier, per rank (measured after one step)", ""]
    lines += _table(
        ["configuration", "device", "host", "NVMe", "device peak"],
        [
            [label, "out of memory", "", "", ""]
            if row.get("out_of_memory")
            else [
                label,
                *(format_bytes(row[t]) for t in ("device", "host", "nvme")),
                format_bytes(row["device_peak"]),
            ]
            for label, row in memory.items()
        ],
    )
    lines += [""] + _image(out, "memory_per_tier.png", "memory per tier")
    largest = results.get("largest")
    if largest:
        plain, offloaded = largest["without"], largest["with"]
        lines += [
            "## 5. The largest model under the budget",
            "",
            f"Without offload (stage 0, bf16): **{plain['params'] / 1e6:.1f}M** parameters train; the next "
            f"width runs out of memory. With stage 3 + parameter and optimizer offload: "
            f"**{offloaded['params'] / 1e6:,.0f}M** parameters train, losses "
            + " -> ".join(f"{v:.3f}" for v in offloaded["losses"])
            + f", device peak {format_bytes(offloaded['device_peak'])}, host "
            f"{format_bytes(offloaded['host_bytes'])}: **{offloaded['params'] / plain['params']:.0f}x**. "
            "The paper: 13B on one 32 GB V100 against 1.4B for PyTorch. "
            f"Adam's moments were stored in {offloaded.get('moments', 'fp32')} on the host.",
            "",
        ]
        if largest.get("host_capacity"):
            lines += [f"What the 8-bit moments buy: {host_capacity_line(largest['host_capacity'])}.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
