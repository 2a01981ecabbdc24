"""`zo train`: a training run from a DeepSpeed-style config, under torchrun or in one process.

Its options are built here, beside the code that runs them; the errors a user can fix become exit status 2,
the others 1.
"""

from __future__ import annotations

import sys

HELP = "train the tiny GPT with a DeepSpeed-style config (works under torchrun)"


def add_arguments(parser) -> None:
    parser.add_argument("--config", required=True, help="path to a DeepSpeed-style JSON config")
    parser.add_argument("--model", default="tiny", help="model preset: nano, tiny, small, 10m, 100m, 1b")
    parser.add_argument(
        "--steps", type=int, default=100, help="train up to this step (with --resume: in all)"
    )
    parser.add_argument("--out", default="out/train", help="report, plots and checkpoints/ go here")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="evaluate on held-out text every N steps and at the end (0: never)",
    )
    parser.add_argument(
        "--eval-batches", type=int, default=4, metavar="B", help="global batches an evaluation reads"
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="checkpoint to OUT/checkpoints/step_<n> every N steps and at the end (0: never)",
    )
    parser.add_argument("--keep", type=int, default=2, help="checkpoints to keep, newest first")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint under OUT/checkpoints",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="how long a collective waits for a rank that stopped answering "
        "(default: ZO_DIST_TIMEOUT, else 300)",
    )


def run(args) -> int:
    from ...config import ConfigError
    from ...engine.divergence import TrainingDivergedError
    from ...implementation.checkpoint import CheckpointError
    from .trainer import RankLostError, train

    try:
        train(
            args.config,
            model=args.model,
            steps=args.steps,
            out=args.out,
            seed=args.seed,
            eval_every=args.eval_every,
            eval_batches=args.eval_batches,
            save_every=args.save_every,
            keep=args.keep,
            resume=args.resume,
            timeout=args.timeout,
        )
    except (ConfigError, CheckpointError, NotImplementedError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RankLostError, TrainingDivergedError) as err:  # not the user's input: says how to resume
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
