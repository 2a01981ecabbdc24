"""The demo's report: out/demo/report.md, the numbers of each part with its plots, readable on GitHub or in VS Code."""

from __future__ import annotations

from pathlib import Path

from ...units import format_bytes, format_gb
from .parts import host_capacity_line


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _image(out: Path, name: str, alt: str) -> list[str]:
    return [f"![{alt}]({name})", ""] if (out / name).exists() else []


# Ratios within this much of 1.0 are "about the same": a shared machine drifts by a few per cent between rounds.
SAME = 0.05
SERIAL, OVERLAPPED, DELAYED = "serial", "overlapped", "delayed (DPU)"


def _speed(ratio: float) -> str:
    """'1.15x as fast as', or for a ratio below 1, 'slower: it took 1.08x as long as'."""
    if ratio >= 1:
        return f"{ratio:.2f}x as fast as"
    return f"slower: it took {1 / ratio:.2f}x as long as"


def _where(cores: str) -> str:
    if cores == "shared":
        return "the same cores and memory bandwidth (cores shared)"
    return "one memory bandwidth and cache (each side has its own core, but the two cores share those)"


def _what_grew(r: dict, base: str, other: str) -> str | None:
    """Why schedule `other` gained nothing on `base`, from what its device's thread did with the time: more work
    of its own, more time blocked on events, or more time runnable but off its core. The largest of the three
    that grew by more than SAME of the base step is named; None if none did."""
    busy, mean = r["busy_ms"], r["mean_ms"]

    def rest(name: str) -> float:
        return mean[name] - busy[name]["device"] - busy[name]["waited"]

    grew = {
        "work": busy[other]["device"] - busy[base]["device"],
        "blocked": busy[other]["waited"] - busy[base]["waited"],
        "off core": rest(other) - rest(base),
    }
    kind, ms = max(grew.items(), key=lambda item: item[1])
    if ms <= SAME * r["median_ms"][base]:
        return None
    if kind == "work":
        return (
            f"The device's own work grew from {busy[base]['device']:.1f} to {busy[other]['device']:.1f} ms of "
            f"CPU a step: the emulated device's compute and the host's Adam ran at the same time on "
            f"{_where(r['cores'])}, so what was hidden came back as slower device work."
        )
    if kind == "blocked":
        return (
            f"The device's thread was blocked {busy[other]['waited']:.1f} ms a step (against "
            f"{busy[base]['waited']:.1f} in {base}) on copies, staging slots or the host's Adam: the host's side "
            "fell behind the device's."
        )
    return (
        f"The device's thread spent {ms:.1f} ms a step more able to run but not running: each unit is handed "
        "between the pipeline's threads in Python, every handover needs the GIL"
        + (
            ", and the threads also wait for the shared cores."
            if r["cores"] == "shared"
            else " (or its core was busy with another process)."
        )
    )


def explain_schedules(r: dict) -> list[str]:
    """Plain sentences on what each ratio of compare_schedules' result `r` says, the cause chosen by what was
    measured: the per-round ratios, the CPU time each side used a step and the waits (busy_ms, mean_ms), and
    the bound (bound_ms)."""
    busy, cores = r["busy_ms"], r["cores"]
    sentences = []
    ratio = r["overlapped_vs_serial"]
    head = f"Overlapped was {_speed(ratio)} serial (median of each round's serial / overlapped time, {ratio:.2f}x)."
    if ratio >= 1 + SAME:
        cause = (
            "The host's Adam and the copies ran while the device was still in backward, so most of the serial "
            "step's tail after backward was hidden."
        )
    else:
        cause = _what_grew(r, SERIAL, OVERLAPPED) or (
            f"The host's work was small next to the device's ({busy[SERIAL]['host']:.1f} against "
            f"{busy[SERIAL]['device']:.1f} ms of CPU a serial step), so there was little to hide."
        )
    sentences.append(f"{head} {cause}")
    ratio = r["delayed_vs_overlapped"]
    head = f"DPU was {_speed(ratio)} overlapped" + (f" ({ratio:.2f}x)." if ratio < 1 else ".")
    host, device = busy[DELAYED]["host"], busy[DELAYED]["device"]
    if ratio >= 1 + SAME:
        cause = (
            "Each step's Adam ran under the next step's forward and backward, so the device no longer waited "
            "for the host at the end of a step."
        )
    elif grew := _what_grew(r, OVERLAPPED, DELAYED):
        cause = grew
    elif cores == "split" and host < device:
        cause = (
            f"The host's work ({host:.1f} ms of CPU a step) was already shorter than the device's "
            f"({device:.1f} ms) and hidden behind backward, so moving Adam a step later had little left to hide."
        )
    else:
        cause = (
            f"Both sides were busy ({device:.1f} ms device, {host:.1f} ms host of CPU a step) on {_where(cores)}: "
            "running Adam beside forward as well only moved work from one side's cores to the other's."
        )
    sentences.append(f"{head} {cause}")
    of_bound, bound = r["of_bound"][DELAYED], r["bound_ms"][DELAYED]
    head = (
        f"DPU's step took {of_bound:.2f}x its bound, {bound:.1f} ms: the busier side's CPU time a step, "
        "the shortest step its work allows."
    )
    if of_bound <= 1 + SAME:
        cause = "It hid nearly everything the other side did."
    else:
        waited = busy[DELAYED]["waited"]
        rest = r["mean_ms"][DELAYED] - device - waited
        cause = (
            f"Of the rest, the device's thread was blocked {waited:.1f} ms a step on copies, slots or the "
            f"host, and {max(rest, 0.0):.1f} ms it could have run but did not (waiting for the GIL or a core)."
        )
    sentences.append(f"{head} {cause}")
    return sentences


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
