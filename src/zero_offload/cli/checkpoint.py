"""`zo checkpoint to-fp32`: one plain PyTorch state_dict of fp32 weights from a checkpoint of any world size."""

from __future__ import annotations

import sys

HELP = "checkpoint tools: zo checkpoint to-fp32 DIR OUT.pt"


def add_arguments(parser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    to_fp32 = actions.add_parser(
        "to-fp32", help="one plain PyTorch state_dict of fp32 weights, for model.load_state_dict"
    )
    to_fp32.add_argument("dir", help="the checkpoint directory engine.save_checkpoint wrote")
    to_fp32.add_argument("out", help="the .pt file to write")


def run(args) -> int:
    from ..implementation.checkpoint import CheckpointError, checkpoint_folder, read_meta, to_fp32

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
