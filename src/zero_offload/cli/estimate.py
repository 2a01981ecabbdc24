"""`zo estimate`: the bytes of the model states on each tier, for a parameter count and a ZeRO setup."""

from __future__ import annotations

import sys

from ..units import format_gb
from .arguments import parse_count

HELP = "model-state bytes per tier for a parameter count"


def add_arguments(parser) -> None:
    parser.add_argument("params", type=parse_count, help="e.g. 13B, 350M, 1e9")
    parser.add_argument("--stage", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--offload-optimizer", default="none", choices=["none", "cpu", "nvme"])
    parser.add_argument("--offload-param", default="none", choices=["none", "cpu", "nvme"])
    parser.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"])
    parser.add_argument(
        "--moments",
        default="fp32",
        choices=["fp32", "bf16", "int8"],
        help="precision of Adam's m and v: fp32 (4 bytes each), bf16 (2), int8 (1, a scale per 2048)",
    )


def run(args) -> int:
    from ..basics.memory import estimate_model_states

    try:
        est = estimate_model_states(
            args.params,
            stage=args.stage,
            world_size=args.world_size,
            offload_optimizer=args.offload_optimizer,
            offload_param=args.offload_param,
            precision=args.precision,
            moments=args.moments,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"{args.params:,} parameters, {args.precision}, ZeRO stage {args.stage}, {args.world_size} rank(s), "
        f"offload_optimizer={args.offload_optimizer}, offload_param={args.offload_param}, "
        f"{args.moments} moments — bytes per rank:"
    )
    print(est.table())
    print(
        f"device {format_gb(est.device)}, host {format_gb(est.host)}, nvme {format_gb(est.nvme)} (1 GB = 1e9 B)"
    )
    return 0
