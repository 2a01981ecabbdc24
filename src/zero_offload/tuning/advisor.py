"""The advisor on top of perfmodel.py: which configuration to run, and what is wrong with the one chosen.

The course introduction ends with a table of common mistakes. Here each row is a rule that computes its
numbers for the hardware and model at hand, instead of quoting a rule of thumb:

  "offload is always faster"        offload-not-needed, cpu-step-dominates
  "pin_memory does not matter"      pin-memory (with the measured pinned/pageable ratio), pin-memory-limit
  "stage 3 plus every offload"      offload-param-not-needed, stage3-traffic
  "the host has memory enough"      host-memory (bytes a parameter: model states + staging, computed)

`recommend` picks the fastest configuration that fits, and where the device has room for part of the
optimizer, the smallest offload ratio that fits (the share of the optimizer step run on the host).

`plan_layouts` does the same for each layout of data, tensor and pipeline parallelism (parallel.py). What
`zo plan` prints and draws from these is plan_report.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..units import format_gb as gb
from .parallel import layouts
from .perfmodel import HOST_RESERVE, Hardware, Plan, Workload, plan, plan_all

__all__ = [
    "Advice",
    "Recommendation",
    "advise",
    "plan_layouts",
    "recommend",
    "smallest_ratio",
]

PIN_WARN_FRACTION = 0.8  # pinned pages cannot be swapped: pinning most of the RAM starves everything else
RATIO_STEP = 0.05  # partial-offload ratios are suggested in steps of 5%


@dataclass(frozen=True)
class Advice:
    level: str  # "info", "warning" or "error"
    rule: str  # a short name, stable for tests and for the course text
    message: str


def advise(hw: Hardware, wl: Workload, chosen: Plan, plans: list[Plan]) -> list[Advice]:
    """What the introduction's table of mistakes says about `chosen`, computed for this hardware and model."""
    advice, t, offloads = [], chosen.time, chosen.offload != "none"
    on_device = [p for p in plans if p.offload == "none" and p.fits]
    if offloads and on_device:  # mistake 1: "offload is always faster"
        best = min(on_device, key=lambda p: p.time.serial)
        why = (
            f"{best.label} fits without offload ({gb(best.device_bytes)} of {gb(best.device_usable)} per GPU) "
            f"and is predicted {best.time.serial:.3g} s a step against {t.serial:.3g} s: offloading adds a CPU "
            f"step of {t.cpu_adam:.3g} s and {t.pcie:.3g} s of PCIe copies to save memory that is not needed"
        )
        advice.append(Advice("warning", "offload-not-needed", why))
    if offloads and t.cpu_adam > t.compute:
        threads, more = hw.cpu_adam_saturating_threads(), ""
        if threads > hw.cpu_adam_threads:
            more = (
                f"give the CPU Adam {threads} threads a rank ({hw.cpu_adam_threads} now: "
                f"{hw.cpu_adam_rank_params_per_s() / 1e9:.3g} against "
                f"{hw.cpu_adam_rank_params_per_s(threads) / 1e9:.3g} Gparam/s), "
            )
        why = (
            f"the CPU step ({t.cpu_adam:.3g} s) is longer than forward + backward ({t.compute:.3g} s), so the "
            f"GPU waits on every step; {more}offload a smaller ratio, or raise the batch (compute grows with "
            "it, the CPU step does not)"
        )
        advice.append(Advice("warning", "cpu-step-dominates", why))
    if offloads:  # mistake 2: forgetting pin_memory
        if hw.pageable_link_gb_per_s:
            why = (
                f"pinned copies ran {hw.link_gb_per_s / hw.pageable_link_gb_per_s:.1f}x faster than pageable "
                f"ones here ({hw.link_gb_per_s:.3g} against {hw.pageable_link_gb_per_s:.3g} GB/s)"
            )
        else:
            why = (
                "pageable copies go through the driver's bounce buffer and block the host (measure the gain "
                "with `zo plan --calibrate` on the GPU host)"
            )
        advice.append(
            Advice("info", "pin-memory", f'set "pin_memory": true: {why}; only pinned copies overlap')
        )
        if chosen.host_bytes > PIN_WARN_FRACTION * hw.host_memory:
            why = (
                f"pinning {gb(chosen.host_bytes)} of {gb(hw.host_memory)} of host memory leaves little for "
                "anything else, and may fail: check `ulimit -l` and the container's memory limit"
            )
            advice.append(Advice("warning", "pin-memory-limit", why))
    lighter = [p for p in plans if p.offload == "optimizer" and p.fits]
    if chosen.offload == "optimizer+param" and lighter:  # mistake 3: stage 3 and every offload, stacked
        best = min(lighter, key=lambda p: p.pcie_bytes)
        why = (
            f"offload_param sends the weights over PCIe for every gather: {gb(chosen.pcie_bytes)} a step per "
            f"GPU against {gb(best.pcie_bytes)} for {best.label}, which fits already"
        )
        advice.append(Advice("warning", "offload-param-not-needed", why))
    if chosen.stage == 3:  # stage 3's gathers, and offload_param's copies, where stage 2 would do
        lighter_offload = "optimizer" if chosen.offload == "optimizer+param" else chosen.offload
        stage2 = [p for p in plans if p.stage == 2 and p.offload == lighter_offload and p.ratio in (0, 1)]
        if stage2 and stage2[0].fits and stage2[0].time.serial < t.serial:
            other = stage2[0]
            why = (
                f"{other.label} fits ({gb(other.device_bytes)} per GPU, host {gb(other.host_bytes)}) and is "
                f"predicted {other.time.serial:.3g} s a step against {t.serial:.3g} s: stage 3 gathers the "
                "weights in forward and again in backward"
            )
            if hw.gpus > 1:
                why += f" (GPU-to-GPU {t.comm:.3g} s against {other.time.comm:.3g} s)"
            if chosen.pcie_bytes > other.pcie_bytes:
                why += (
                    f", and offload_param sends them over PCIe for each gather: "
                    f"{gb(chosen.pcie_bytes - other.pcie_bytes)} more a step per GPU "
                    f"({gb(chosen.pcie_bytes)} against {gb(other.pcie_bytes)}, {t.pcie:.3g} s against "
                    f"{other.time.pcie:.3g} s)"
                )
            advice.append(Advice("warning" if chosen.offload != "none" else "info", "stage3-traffic", why))
    if offloads and hw.sockets > 1:  # NUMA: each rank's CPU Adam on its own socket's cores and memory
        advice.append(
            Advice("info", "numa", numa_message(hw, t.cpu_adam, chosen.ratio * wl.params / hw.gpus))
        )
    if offloads:  # mistake 4: not reserving host memory
        per_param = chosen.host_bytes / wl.params
        of_states = hw.gpus * chosen.states.host / wl.params
        why = (
            f"host memory: {gb(chosen.host_bytes)} = {per_param:.1f} bytes a parameter ({of_states:.1f} of "
            f"model states + {per_param - of_states:.1f} of staging buffers) of {gb(chosen.host_usable)} "
            f"usable ({gb(hw.host_memory)} less {HOST_RESERVE:.0%} for the system)"
        )
        advice.append(
            Advice("info" if chosen.host_bytes <= chosen.host_usable else "error", "host-memory", why)
        )
    return advice


def numa_message(hw: Hardware, cpu_seconds: float, params_on_host: float) -> str:
    """What the host's sockets mean for the CPU Adam, and how to launch for it."""
    socket_gb = hw.host_memory_gb_per_s / hw.sockets
    text = (
        f"the host has {hw.sockets} sockets of {socket_gb:.3g} GB/s of memory each; the model gives each rank "
        f"its own socket's share ({hw.ranks_per_socket} rank(s) a socket, "
        f"{hw.cpu_adam_rank_share() / 1e9:.3g} Gparam/s each): launch with `deepspeed --bind_cores_to_rank`, "
        "which gives each rank its own cores and, where they lie on one socket, that socket's memory"
    )
    if hw.gpus < hw.sockets and not hw.numa_spread:
        spread = replace(hw, numa_spread=True)
        threads = max(hw.cpu_adam_threads, spread.cpu_adam_saturating_threads())
        spread = replace(spread, cpu_adam_threads=threads)
        saved = params_on_host * (
            1 / hw.cpu_adam_rank_params_per_s() - 1 / spread.cpu_adam_rank_params_per_s()
        )
        text += (
            f"; a rank alone on {hw.sockets} sockets gets one socket's {hw.cpu_adam_rank_share() / 1e9:.3g}: with "
            f"{threads} threads over every socket and its memory interleaved (numactl --interleave=all) it "
            f"reaches up to {spread.cpu_adam_rank_params_per_s() / 1e9:.3g}, half its traffic crossing the "
            f"inter-socket link, and the CPU step of {cpu_seconds:.3g} s would take about "
            f"{max(0.0, cpu_seconds - saved):.3g} s"
        )
    return text


def smallest_ratio(hw: Hardware, wl: Workload, stage: int) -> float | None:
    """The smallest offload_optimizer.ratio, in 5% steps, whose device memory fits; None if even 1.0 does not.

    The less the host takes, the less the CPU works: the device keeps what it has room for.
    """
    for step in range(1, round(1 / RATIO_STEP) + 1):
        ratio = round(step * RATIO_STEP, 2)
        candidate = plan(hw, wl, stage, "optimizer", ratio)
        if candidate.device_bytes <= candidate.device_usable:
            return ratio
    return None


@dataclass
class Recommendation:
    plan: Plan | None  # None: nothing fits
    workload: Workload  # with recompute switched on where only that makes it fit
    config: dict  # the zero_optimization section (and our own keys) to put in the JSON config
    reasons: list[str]
    advice: list[Advice]


def recommend(hw: Hardware, wl: Workload) -> Recommendation:
    """The fastest configuration that fits, with a partial offload ratio where part of the optimizer fits.

    Plans are evaluated with the CPU Adam thread count the config recommends: the saturation point of
    Hardware.cpu_adam_saturating_threads, where more threads stop adding throughput.
    """
    hw = replace(hw, cpu_adam_threads=hw.cpu_adam_saturating_threads())
    plans = plan_all(hw, wl)
    candidates = [p for p in plans if p.fits and p.offload != "optimizer"]
    for stage in (1, 2, 3):
        ratio = smallest_ratio(hw, wl, stage)
        if ratio is not None and plan(hw, wl, stage, "optimizer", ratio).fits:
            candidates.append(plan(hw, wl, stage, "optimizer", ratio))
    if not candidates:
        retry = recommend(hw, replace(wl, recompute=True)) if not wl.recompute else None
        if retry is not None and retry.plan is not None:
            retry.reasons.insert(
                0,
                f"activations of batch {wl.batch} x {wl.seq_len} tokens take "
                f"{gb(wl.activation_bytes())} per GPU: nothing fits without activation "
                f"checkpointing, which keeps {gb(retry.workload.activation_bytes())}",
            )
            return retry
        least = min(plans, key=lambda p: p.device_bytes)
        why = (
            f"nothing fits: the least device memory is {gb(least.device_bytes)} ({least.label}) of "
            f"{gb(least.device_usable)} usable per GPU, host {gb(least.host_bytes)} of {gb(least.host_usable)};"
            " use more GPUs, a smaller batch, or the NVMe tier (module 5)"
        )
        return Recommendation(None, wl, {}, [why], [])
    best = min(candidates, key=lambda p: p.preference)
    reasons = [
        f"{best.label}: device {gb(best.device_bytes)} of {gb(best.device_usable)} usable per GPU, host "
        f"{gb(best.host_bytes)} of {gb(best.host_usable)}; predicted {best.time.serial:.3g} s a step "
        f"serial, {best.time.overlapped:.3g} s overlapped (bottleneck: {best.time.bottleneck})"
    ]
    zero: dict = {"stage": best.stage}
    config: dict = {"zero_optimization": zero}
    if best.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if best.ratio < 1:
            zero["offload_optimizer"]["ratio"] = best.ratio
            reasons.append(
                f"ratio {best.ratio:g}: the device has room for the optimizer of "
                f"{1 - best.ratio:.0%} of the parameters; the CPU steps only the rest"
            )
        if best.offload == "optimizer+param":
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        threads = hw.cpu_adam_threads
        config["zero_offload"] = {"cpu_adam": {"impl": "simd", "threads": threads}}
        share = hw.cpu_adam_rank_share()
        reach = (
            "which they reach; more would add nothing"
            if hw.cpu_adam_rank_params_per_s() >= share * (1 - 1e-9)
            else f"of which they reach {hw.cpu_adam_rank_params_per_s() / 1e9:.3g}, all the cores a rank has"
        )
        reasons.append(
            f"CPU Adam threads: {threads} per rank: one thread updates "
            f"{hw.cpu_adam_thread_params_per_s / 1e9:.3g} Gparam/s, a rank's share of the host's "
            f"{hw.cpu_adam_params_per_s / 1e9:.3g} is {share / 1e9:.3g} ({hw.gpus} rank(s) on {hw.sockets} "
            f"socket(s), {hw.cores_per_rank} cores each), {reach}"
        )
    if wl.recompute:
        config["activation_checkpointing"] = {}
    return Recommendation(best, wl, config, reasons, advise(hw, wl, best, plans))


def plan_layouts(hw, wl, node_counts: tuple[int, ...] | None = None) -> list[tuple]:
    """(hardware, layout, the fastest plan that fits or None, the plan with the least device memory) for each
    layout on `node_counts` hosts (default: hw.nodes and twice as many); full offload only."""
    counts = node_counts or (hw.nodes, 2 * hw.nodes)
    rows = []
    for nodes in counts:
        job = replace(hw, nodes=nodes)
        for layout in layouts(job):
            choices = [(0, "none"), (1, "none"), (1, "optimizer")]
            if layout.pp == 1:
                choices += [
                    (2, "none"),
                    (2, "optimizer"),
                    (3, "none"),
                    (3, "optimizer"),
                    (3, "optimizer+param"),
                ]
            plans = [plan(job, wl, stage, offload, layout=layout) for stage, offload in choices]
            fitting = [p for p in plans if p.fits]
            best = min(fitting, key=lambda p: p.preference) if fitting else None  # as recommend ranks
            rows.append((job, layout, best, min(plans, key=lambda p: p.device_bytes)))
    return rows
