"""`zo plan`: the performance model's verdict on every ZeRO stage x offload, and advice on the user's choice.

Its options are built here (add_arguments) beside what the command does with them (run).
"""

from __future__ import annotations

import sys

from .arguments import parse_count, parse_size

HELP = "predict memory and step time of every ZeRO stage x offload, and advise"


def add_arguments(parser) -> None:
    parser.add_argument("--params", type=parse_count, required=True, help="e.g. 13B, 350M, 1e9")
    parser.add_argument(
        "--preset",
        default="a100-80g",
        choices=["v100-32g", "a100-80g", "h200", "this-cpu"],
        help="hardware figures to start from (this-cpu: this whole machine, measured)",
    )
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this host's CPU Adam (by thread count) and memory bandwidth, and the PCIe link where "
        "CUDA is present, in place of the preset's; capacities (GPUs, GPU and host memory, cores) stay "
        "the preset's or --gpus/--gpu-memory/--host-memory (--preset this-cpu measures them too)",
    )
    parser.add_argument("--gpus", type=int, help="GPUs on the host, one rank each")
    parser.add_argument("--gpu-memory", type=parse_size, help="per GPU, e.g. 80GB")
    parser.add_argument("--host-memory", type=parse_size, help="e.g. 256GB")
    parser.add_argument("--link", type=float, help="device<->host GB/s per GPU and direction (PCIe)")
    parser.add_argument("--tflops", type=float, help="peak dense TFLOP/s per GPU")
    parser.add_argument("--mfu", type=float, help="share of peak a training step reaches (default 0.4)")
    parser.add_argument(
        "--cpu-adam",
        type=parse_count,
        help="the host's CPU Adam throughput, all ranks together, parameters/s (e.g. 5G)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU Adam threads a rank (--calibrate measures up to it; default: the engine's)",
    )
    parser.add_argument("--batch", type=int, default=1, help="micro-batch per GPU, in sequences")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length in tokens")
    parser.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument(
        "--moments",
        default="fp32",
        choices=["fp32", "bf16", "int8"],
        help="how the host's Adam stores m and v (zero_offload.cpu_adam.states): fewer host bytes, and a CPU "
        "step modelled as memory-bound over fewer bytes",
    )
    parser.add_argument("--recompute", action="store_true", help="with activation checkpointing")
    parser.add_argument(
        "--units", type=int, help="tensors the CPU Adam updates per step (default: 6 a layer)"
    )
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="check this choice against the rules")
    parser.add_argument("--offload", default="none", choices=["none", "optimizer", "optimizer+param"])
    parser.add_argument(
        "--plot", metavar="DIR", help="save plots of step time against batch and link bandwidth"
    )


def run(args) -> int:
    """`zo plan`: every stage x offload on a preset, and a recommendation. `--preset this-cpu` measures this
    whole machine; `--calibrate` on another preset measures only the CPU Adam and the host's memory bandwidth
    (and the PCIe link where CUDA is present): capacities come from the preset or --gpu-memory/--host-memory."""
    from dataclasses import replace

    from ..tuning import perfmodel
    from ..tuning.advisor import advise, plan_layouts, recommend
    from ..tuning.plan_report import describe, format_layouts, format_plans, format_recommendation, save_plots

    at_least_one = {
        "gpus": args.gpus,
        "batch": args.batch,
        "seq": args.seq,
        "threads": args.threads,
        "units": args.units,
        "params": args.params,
    }
    positive = {
        "link": args.link,
        "tflops": args.tflops,
        "cpu-adam": args.cpu_adam,
        "gpu-memory": args.gpu_memory,
        "host-memory": args.host_memory,
    }
    problems = [f"--{name} must be at least 1" for name, v in at_least_one.items() if v is not None and v < 1]
    problems += [f"--{name} must be more than 0" for name, v in positive.items() if v is not None and v <= 0]
    if args.mfu is not None and not 0 < args.mfu <= 1:
        problems.append("--mfu is a share of the peak TFLOP/s, in (0, 1], e.g. 0.4")
    if problems:
        hint = " (--gpus 1 for a single GPU)" if args.gpus is not None and args.gpus < 1 else ""
        print(f"error: {'; '.join(problems)}{hint}", file=sys.stderr)
        return 2
    # --calibrate replaces the preset's CPU Adam figures and host memory bandwidth (and, with CUDA, the link);
    # the capacities stay the preset's or the options'. Only this-cpu describes this whole machine.
    if args.preset == "this-cpu" or args.calibrate:
        print("calibrating: timing this machine's CPU Adam and memory ...", file=sys.stderr)
        base = None if args.preset == "this-cpu" else perfmodel.PRESETS[args.preset]
        hw = perfmodel.calibrate(base, threads=args.threads, precision=args.precision)
    else:
        hw = perfmodel.PRESETS[args.preset]
    overrides = {
        "gpus": args.gpus,
        "gpu_memory": args.gpu_memory,
        "host_memory": args.host_memory,
        "link_gb_per_s": args.link,
        "gpu_tflops": args.tflops,
        "mfu": args.mfu,
        "cpu_adam_params_per_s": args.cpu_adam,
        "cpu_adam_threads": args.threads,
    }
    hw = replace(hw, **{key: value for key, value in overrides.items() if value is not None})
    wl = perfmodel.Workload(
        args.params,
        batch=args.batch,
        seq_len=args.seq,
        precision=args.precision,
        moments=args.moments,
        recompute=args.recompute,
        units=args.units,
    )
    plans = perfmodel.plan_all(hw, wl)
    print(describe(hw, wl), format_plans(plans), format_recommendation(recommend(hw, wl)), sep="\n\n")
    print(f"\n{format_layouts(plan_layouts(hw, wl))}")
    if args.stage is not None:  # the user's own choice, checked against the rules
        try:
            mine = perfmodel.plan(hw, wl, args.stage, args.offload)
        except ValueError as err:
            print(f"error: --stage {args.stage} --offload {args.offload}: {err}", file=sys.stderr)
            return 2
        fits = "fits" if mine.fits else "does not fit"
        print(f"\nYour choice, {mine.label}: {fits}, predicted {mine.time.serial:.3g} s a step (serial)")
        for advice in advise(hw, wl, mine, plans):
            print(f"  {advice.level}: [{advice.rule}] {advice.message}")
    if args.plot:
        for path in save_plots(hw, wl, args.plot):
            print(f"plot: {path}")
    return 0
