"""`zo train` and `zo checkpoint to-fp32`: a training run, and the plain PyTorch weights of its checkpoints.

cli/main.py builds the options; these turn the errors a user can fix into exit status 2, the others into 1.
"""

from __future__ import annotations

import sys


def run_train(args) -> int:
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


def run_checkpoint(args) -> int:
    from ...implementation.checkpoint import CheckpointError, checkpoint_folder, read_meta, to_fp32

    try:
        folder = checkpoint_folder(args.dir)  # once: it warns of an unfinished save it skips
        meta = read_meta(folder)
        state = to_fp32(folder, args.out)
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
