"""The `zo` command: demo, train, estimate, bench, grade, check-config, checkpoint."""

from __future__ import annotations

import argparse
import json
import sys

from .units import format_gb

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
    from .basics.memory import estimate_model_states

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


def _check_config(args) -> int:
    from .config import ConfigError, load_config

    try:
        config = load_config(args.path, world_size=args.world_size)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(config.to_dict(), indent=2))
    print(
        f"OK: {args.path} is valid for {args.world_size} rank(s); fingerprint {config.fingerprint()[:12]}",
        file=sys.stderr,
    )
    return 0


def _train(args) -> int:
    from .config import ConfigError
    from .practice.trainer import train

    try:
        train(args.config, model=args.model, steps=args.steps, out=args.out, seed=args.seed)
    except (ConfigError, NotImplementedError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def _checkpoint(args) -> int:
    from .implementation.checkpoint import CheckpointError, read_meta, to_fp32

    try:
        meta = read_meta(args.dir)
        state = to_fp32(args.dir, args.out)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    tensors = {id(t): t for t in state.values()}.values()  # a tied weight is one tensor, stored once
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(
        f"wrote {args.out}: {len(state)} entries ({len(state) - len(tensors)} tied), "
        f"{sum(t.numel() for t in tensors):,} elements, {nbytes / 1e6:.1f} MB: the fp32 weights at step "
        f"{meta['global_steps']} of a {meta['world_size']}-rank, ZeRO stage {meta['stage']}, "
        f"{meta['precision']} checkpoint"
    )
    print(f"load it with: model.load_state_dict(torch.load({args.out!r}, weights_only=True))")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zo", description="zero-offload: the course's engine and tools")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the instructor's end-to-end demo (writes out/demo/report.md)")
    demo.add_argument("--out", default="out/demo")
    demo.add_argument("--steps", type=int, default=300)

    est = sub.add_parser("estimate", help="model-state bytes per tier for a parameter count")
    est.add_argument("params", type=parse_count, help="e.g. 13B, 350M, 1e9")
    est.add_argument("--stage", type=int, default=0, choices=[0, 1, 2, 3])
    est.add_argument("--world-size", type=int, default=1)
    est.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"])
    est.add_argument("--offload-param", default="none", choices=["none", "cpu", "nvme"])
    est.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"])

    train = sub.add_parser(
        "train", help="train the tiny GPT with a DeepSpeed-style config (works under torchrun)"
    )
    train.add_argument("--config", required=True, help="path to a DeepSpeed-style JSON config")
    train.add_argument("--model", default="tiny", help="model preset: nano, tiny, small, 10m, 100m, 1b")
    train.add_argument("--steps", type=int, default=100)
    train.add_argument("--out", default="out/train")
    train.add_argument("--seed", type=int, default=0)

    bench = sub.add_parser("bench", help="benchmarks, reported as ratios from one run (out/bench/)")
    bench.add_argument("--out", default="out/bench")
    bench.add_argument("--numel", type=parse_count, default=16_700_000)
    bench.add_argument("--repeats", type=int, default=10)

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
        from .demo import run_demo

        run_demo(args.out, steps=args.steps)
        return 0
    if args.command == "train":
        return _train(args)
    if args.command == "estimate":
        return _estimate(args)
    if args.command == "bench":
        from .bench import run_bench

        run_bench(args.out, numel=args.numel, repeats=args.repeats)
        return 0
    if args.command == "grade":
        from .grading import main as grade_main

        return grade_main(args.rest)
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "checkpoint":
        return _checkpoint(args)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
