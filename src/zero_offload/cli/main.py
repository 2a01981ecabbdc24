"""The `zo` command: demo, train, estimate, plan, bench, grade, check-config, checkpoint."""

from __future__ import annotations

import argparse
import json
import sys

from ..units import format_gb
from .bench.sections import SECTIONS as BENCH_SECTIONS
from .plan import run_plan
from .train.command import run_checkpoint, run_train

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """'13B' -> 13_000_000_000, '350M' -> 350_000_000, '1e9' -> 1_000_000_000."""
    text = text.strip().upper()
    try:
        if text and text[-1] in _SUFFIXES:
            return int(float(text[:-1]) * _SUFFIXES[text[-1]])
        return int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read {text!r} as a parameter count (e.g. 13B, 350M, 1e9)"
        ) from None


def _estimate(args) -> int:
    from ..basics.memory import estimate_model_states

    try:
        est = estimate_model_states(
            args.params,
            stage=args.stage,
            world_size=args.world_size,
            offload_optimizer=args.offload_optimizer,
            offload_param=args.offload_param,
            precision=args.precision,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"{args.params:,} parameters, {args.precision}, ZeRO stage {args.stage}, {args.world_size} rank(s), "
        f"offload_optimizer={args.offload_optimizer}, offload_param={args.offload_param} — bytes per rank:"
    )
    print(est.table())
    print(
        f"device {format_gb(est.device)}, host {format_gb(est.host)}, nvme {format_gb(est.nvme)} (1 GB = 1e9 B)"
    )
    return 0


def _size(text: str) -> int:
    from ..units import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _check_config(args) -> int:
    from ..config import ConfigError, check_supported, load_config

    try:
        config = load_config(args.path, world_size=args.world_size)
        check_supported(config)  # the combinations zo.initialize refuses, so that OK here means it runs
    except (ConfigError, NotImplementedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(config.to_dict(), indent=2))
    print(
        f"OK: {args.path} is valid for {args.world_size} rank(s); fingerprint {config.fingerprint()[:12]}",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zo", description="zero-offload: the course's engine and tools")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the instructor's end-to-end demo (writes out/demo/report.md)")
    demo.add_argument("--out", default="out/demo")
    demo.add_argument("--ranks", type=int, default=2, help="processes, launched with torchrun on loopback")
    demo.add_argument("--budget", default="512MiB", help="the emulated device's memory, e.g. 512MiB")
    demo.add_argument("--steps", type=int, default=20, help="training steps of part 2")
    demo.add_argument("--quick", action="store_true", help="small models and budget: a check that it runs")
    demo.add_argument("--ranks-only", action="store_true", help=argparse.SUPPRESS)  # the launcher's ranks

    est = sub.add_parser("estimate", help="model-state bytes per tier for a parameter count")
    est.add_argument("params", type=parse_count, help="e.g. 13B, 350M, 1e9")
    est.add_argument("--stage", type=int, default=0, choices=[0, 1, 2, 3])
    est.add_argument("--world-size", type=int, default=1)
    est.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"])
    est.add_argument("--offload-param", default="none", choices=["none", "cpu", "nvme"])
    est.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"])

    plan = sub.add_parser(
        "plan", help="predict memory and step time of every ZeRO stage x offload, and advise"
    )
    plan.add_argument("--params", type=parse_count, required=True, help="e.g. 13B, 350M, 1e9")
    plan.add_argument(
        "--preset",
        default="a100-80g",
        choices=["v100-32g", "a100-80g", "h200", "this-cpu"],
        help="hardware figures to start from (this-cpu: this whole machine, measured)",
    )
    plan.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this host's CPU Adam (by thread count) and memory bandwidth, and the PCIe link where "
        "CUDA is present, in place of the preset's; capacities (GPUs, GPU and host memory, cores) stay "
        "the preset's or --gpus/--gpu-memory/--host-memory (--preset this-cpu measures them too)",
    )
    plan.add_argument("--gpus", type=int, help="GPUs on the host, one rank each")
    plan.add_argument("--gpu-memory", type=_size, help="per GPU, e.g. 80GB")
    plan.add_argument("--host-memory", type=_size, help="e.g. 256GB")
    plan.add_argument("--link", type=float, help="device<->host GB/s per GPU and direction (PCIe)")
    plan.add_argument("--tflops", type=float, help="peak dense TFLOP/s per GPU")
    plan.add_argument("--mfu", type=float, help="share of peak a training step reaches (default 0.4)")
    plan.add_argument(
        "--cpu-adam",
        type=parse_count,
        help="the host's CPU Adam throughput, all ranks together, parameters/s (e.g. 5G)",
    )
    plan.add_argument(
        "--threads",
        type=int,
        help="CPU Adam threads a rank (--calibrate measures up to it; default: the engine's)",
    )
    plan.add_argument("--batch", type=int, default=1, help="micro-batch per GPU, in sequences")
    plan.add_argument("--seq", type=int, default=1024, help="sequence length in tokens")
    plan.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"])
    plan.add_argument("--recompute", action="store_true", help="with activation checkpointing")
    plan.add_argument("--units", type=int, help="tensors the CPU Adam updates per step (default: 6 a layer)")
    plan.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="check this choice against the rules")
    plan.add_argument("--offload", default="none", choices=["none", "optimizer", "optimizer+param"])
    plan.add_argument(
        "--plot", metavar="DIR", help="save plots of step time against batch and link bandwidth"
    )

    train = sub.add_parser(
        "train", help="train the tiny GPT with a DeepSpeed-style config (works under torchrun)"
    )
    train.add_argument("--config", required=True, help="path to a DeepSpeed-style JSON config")
    train.add_argument("--model", default="tiny", help="model preset: nano, tiny, small, 10m, 100m, 1b")
    train.add_argument("--steps", type=int, default=100, help="train up to this step (with --resume: in all)")
    train.add_argument("--out", default="out/train", help="report, plots and checkpoints/ go here")
    train.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    train.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluate on held-out text every N steps and at the end (0: never)",
    )
    train.add_argument(
        "--eval-batches", type=int, default=4, metavar="B", help="global batches an evaluation reads"
    )
    train.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="checkpoint to OUT/checkpoints/step_<n> every N steps and at the end (0: never)",
    )
    train.add_argument("--keep", type=int, default=2, help="checkpoints to keep, newest first")
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint under OUT/checkpoints",
    )
    train.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="how long a collective waits for a rank that stopped answering "
        "(default: ZO_DIST_TIMEOUT, else 300)",
    )

    bench = sub.add_parser("bench", help="benchmarks, reported as ratios from one run (out/bench/)")
    bench.add_argument("--out", default="out/bench")
    bench.add_argument("--numel", type=parse_count, default=16_700_000)
    bench.add_argument("--rounds", type=int, default=7, help="interleaved rounds; each times every variant")
    bench.add_argument("--threads", type=int, default=2)
    bench.add_argument(
        "--only",
        nargs="+",
        choices=BENCH_SECTIONS,
        default=BENCH_SECTIONS,
        metavar="SECTION",
        help=f"run only these sections ({', '.join(BENCH_SECTIONS)}); results.json keeps the others'",
    )

    grade = sub.add_parser("grade", help="grade a lab: zo grade 1 [--lab-dir solutions]")
    grade.add_argument("rest", nargs=argparse.REMAINDER)

    check = sub.add_parser("check-config", help="validate a DeepSpeed-style JSON config and print it in full")
    check.add_argument("path")
    check.add_argument("--world-size", type=int, default=1)

    ckpt = sub.add_parser("checkpoint", help="checkpoint tools: zo checkpoint to-fp32 DIR OUT.pt")
    ckpt_sub = ckpt.add_subparsers(dest="action", required=True)
    to_fp32 = ckpt_sub.add_parser(
        "to-fp32", help="one plain PyTorch state_dict of fp32 weights, for model.load_state_dict"
    )
    to_fp32.add_argument("dir", help="the checkpoint directory engine.save_checkpoint wrote")
    to_fp32.add_argument("out", help="the .pt file to write")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo.run import run_demo

        run_demo(
            args.out,
            ranks=args.ranks,
            budget=args.budget,
            steps=args.steps,
            quick=args.quick,
            ranks_only=args.ranks_only,
        )
        return 0
    if args.command == "train":
        return run_train(args)
    if args.command == "estimate":
        return _estimate(args)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "bench":
        from .bench.run import run_bench

        run_bench(args.out, numel=args.numel, rounds=args.rounds, threads=args.threads, only=tuple(args.only))
        return 0
    if args.command == "grade":
        from .grade.run import main as grade_main

        return grade_main(args.rest)
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "checkpoint":
        return run_checkpoint(args)
    raise AssertionError(args.command)
