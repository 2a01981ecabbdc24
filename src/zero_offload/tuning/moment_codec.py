"""Adam's m and v in their stored precision, outside the C Adam: cut into a checkpoint's pieces, decoded to
fp32, and encoded again into the buffers of another layout (another world size, another precision).

The tensors' dtypes say how they are stored (state_precision.py): fp32; bf16; or int8 codes (exp_avg
torch.int8, exp_avg_sq torch.uint8 codes of sqrt v) with one fp32 scale per block of BLOCK elements, counted
from the first element of the unit the C Adam updates. A checkpoint piece is any span of a unit, so an int8
piece also keeps the scales of the blocks it touches and where in its first block it starts (`block_offset`).

Decoding and encoding again at the same layout gives back the same codes and scales, bit for bit: a block's
largest element decodes to exactly its scale (top x fl(1 / top) is 1 in fp32 for 127 and 255), so the
encoder finds the same scale, and every other code is recovered within a few ulps of itself.
"""

from __future__ import annotations

import torch

from ..implementation.checkpoint_format import BLOCK_OFFSET, SCALES
from .state_precision import (
    BLOCK,
    blocks,
    dequantize_blocks,
    quantize_blocks,
    square_root,
)

MOMENTS = ("exp_avg", "exp_avg_sq")


def precision_of(exp_avg: torch.Tensor) -> str:
    """How a moment tensor is stored, from its dtype: "fp32", "bf16" or "int8"."""
    if exp_avg.dtype == torch.bfloat16:
        return "bf16"
    if exp_avg.dtype in (torch.int8, torch.uint8):
        return "int8"
    return "fp32"


class MomentCodec:
    """Cuts, decodes and encodes m and v, whatever their precision (the engine's `moment_codec`)."""

    def cut_piece(self, tensors: dict[str, torch.Tensor], offset: int, numel: int) -> dict:
        """Elements [offset, offset + numel) of a unit's `tensors` (master, m, v, ...) as views; with int8
        moments, also the scales of the blocks they touch and `block_offset`, where the piece starts in the
        first of them."""
        piece = {key: t[offset : offset + numel] for key, t in tensors.items() if key not in SCALES}
        if SCALES[0] in tensors:
            first, last = offset // BLOCK, (offset + max(numel, 1) - 1) // BLOCK
            piece.update({key: tensors[key][first : last + 1] for key in SCALES})
            piece[BLOCK_OFFSET] = offset % BLOCK
        return piece

    def decode_piece(self, piece: dict) -> dict[str, torch.Tensor]:
        """The fp32 m and v of a piece cut_piece made (and a checkpoint kept)."""
        m, v = piece["exp_avg"], piece["exp_avg_sq"]
        precision = precision_of(m)
        if precision != precision_of(v):
            raise ValueError(f"exp_avg is {m.dtype} but exp_avg_sq is {v.dtype}")
        if precision != "int8":
            return {"exp_avg": m.float(), "exp_avg_sq": v.float()}
        if (m.dtype, v.dtype) != (torch.int8, torch.uint8):
            raise ValueError(f"8-bit moments must be int8 and uint8 codes, got {m.dtype}, {v.dtype}")
        lead = piece.get(BLOCK_OFFSET)
        if not isinstance(lead, int) or isinstance(lead, bool) or not 0 <= lead < BLOCK:
            raise ValueError(f"{BLOCK_OFFSET} is {lead!r}, expected a whole number below {BLOCK}")
        want = blocks(lead + m.numel())
        for key in SCALES:
            scale = piece.get(key)
            if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.numel() != want:
                got = f"{scale.numel()} of {scale.dtype}" if isinstance(scale, torch.Tensor) else repr(scale)
                raise ValueError(f"{key} must be {want} fp32 scales for these 8-bit moments, got {got}")
        # Decoded as the blocks they came from: the piece's elements after `lead` leading ones of its block.
        m = _in_blocks(m, lead, piece["exp_avg_scale"], signed=True)
        root = _in_blocks(v, lead, piece["exp_avg_sq_scale"], signed=False)
        return {"exp_avg": m, "exp_avg_sq": root * root}

    def encode_into(self, m: torch.Tensor, v: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Write a whole unit's fp32 `m` and `v` into its moment buffers in `tensors`, in their precision: as
        the C Adam would have stored them (int8: per block of this unit, its new scale its largest value)."""
        exp_avg, exp_avg_sq = tensors["exp_avg"], tensors["exp_avg_sq"]
        if precision_of(exp_avg) != "int8":  # fp32, or bf16 rounded to nearest even by the copy
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
            return
        for key, values, signed in (("exp_avg", m, True), ("exp_avg_sq", square_root(v), False)):
            codes, scales = quantize_blocks(values.cpu(), signed=signed)
            tensors[key].copy_(codes)
            tensors[SCALES[MOMENTS.index(key)]].copy_(scales)


def _in_blocks(codes: torch.Tensor, lead: int, scales: torch.Tensor, *, signed: bool) -> torch.Tensor:
    padded = torch.zeros(lead + codes.numel(), dtype=codes.dtype)
    padded[lead:] = codes
    return dequantize_blocks(padded, scales, signed=signed)[lead:]
