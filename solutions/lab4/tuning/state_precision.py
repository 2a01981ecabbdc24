"""Adam's moments stored in bf16 or in 8 bits: the codes, and a pure-torch Adam step that does the C kernel's
arithmetic (csrc/cpu_adam.c, "moments stored in bf16 or 8 bits"), so that the kernel is tested against
readable code.

  fp32  m and v as they are: 8 bytes a parameter.
  bf16  m and v rounded to bf16, nearest even: 4 bytes a parameter.
  int8  m as signed codes, v as unsigned codes of sqrt(v), one byte each, plus one fp32 scale per block of
        BLOCK elements and per moment: 2 bytes and 1/256 of a byte a parameter.

An int8 block's scale is its largest |x| (the value the top code stands for), and a code is x x (127 / scale)
(255 for v), rounded to nearest even; x / scale x 127 where 127 / scale overflows fp32 (scale below ~1e-36). sqrt(v) rather than v: it is on the scale of |m|, so its codes span the same
range of gradient sizes as m's; codes of v itself would set every v below 1/510 of the block's largest to zero,
and the update's denominator to eps. The master weights stay fp32: only the moments are narrow.

Each step decodes the moments to fp32, updates in fp32, and encodes the new moments (a block's new scale is
its new largest value).
"""

from __future__ import annotations

import math

import torch

# int8: elements per scale, blocks counted from the tensor's first element (ZO_STATE_BLOCK in cpu_adam.h)
BLOCK = 2048
# int8: the largest code of m (signed) and of sqrt(v) (unsigned)
M_TOP, V_TOP = 127, 255
PRECISIONS = ("fp32", "bf16", "int8")


def divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b rounded once to fp32, as C's division is. torch's own fp32 division is off by an ulp at times (its
    vector loop may multiply by a reciprocal); in double precision and then rounded to fp32 it is exact, as
    53 bits are more than twice 24 + 2."""
    return (a.double() / b.double()).float()


def square_root(x: torch.Tensor) -> torch.Tensor:
    """sqrt rounded once to fp32, by the same argument as divide()."""
    return torch.sqrt(x.double()).float()


def blocks(n: int) -> int:
    """The number of int8 blocks, and of scales per moment, of a tensor of `n` elements."""
    return math.ceil(n / BLOCK)


# ------------------------------------------------------------------------------------------------- bf16
def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the bits of the nearest bf16 (ties to even; a NaN stays a NaN), as int32 in [0, 65535]: the
    same integer steps as the kernel's float_to_bf16, so that the test compares code with code."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return torch.where(is_nan, (bits >> 16) | 0x40, rounded & 0xFFFF).to(torch.int32)


def bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    """bf16 bits (any integer dtype, or a torch.bfloat16 tensor) -> fp32, exactly."""
    if bits.dtype == torch.bfloat16:
        return bits.float()
    wide = (bits.to(torch.int64) & 0xFFFF) << 16
    return wide.to(torch.int32).view(torch.float32)


# ------------------------------------------------------------------------------------------------- int8
def as_blocks(x: torch.Tensor) -> torch.Tensor:
    """x as rows of BLOCK elements, the last one padded with zeros (they change no block's largest value)."""
    padded = torch.zeros(blocks(x.numel()) * BLOCK, dtype=torch.float32)
    padded[: x.numel()] = x
    return padded.view(-1, BLOCK)


def quantize_blocks(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `x` -> (codes, scales): per block, scale = the largest |x| and code = x x (top / scale) rounded to
    nearest even, top 127 (`signed`, int8 codes) or 255 (x >= 0, uint8 codes); x / scale x top where
    top / scale is infinite in fp32. A block of zeros: scale 0, codes 0."""
    # BEGIN LAB 4.4: blockwise absmax codes of a moment, one scale a block
    # rows = as_blocks(x.flatten()): one row per block of BLOCK elements, counted from element 0, the last
    #   row padded with zeros (they change no block's largest |x|).
    # The scales: each row's largest |x| (the value the top code stands for), one fp32 number a block.
    # The top code: M_TOP = 127 when `signed` (m, int8 codes), V_TOP = 255 otherwise (sqrt(v) >= 0, uint8).
    # A code: x * (top / scale) rounded to nearest, ties to even (torch.round does that), with top / scale
    #   rounded once to fp32 as the C kernel does: divide(torch.full_like(rows, top), scale), a scale per row.
    #   Where that quotient is inf in fp32 (a scale below ~1e-36), take divide(rows, scale) * top instead.
    # A block of zeros: scale 0 and every code 0, without dividing by zero (no NaN may reach the codes).
    # Return (the codes of x's x.numel() elements, flat, torch.int8 if signed else torch.uint8; the scales).
    rows = as_blocks(x.flatten())
    scales = rows.abs().amax(dim=1)
    top = M_TOP if signed else V_TOP
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)[:, None].expand_as(rows)
    times = divide(torch.full_like(rows, top), safe)
    scaled = torch.where(times.isinf(), divide(rows, safe) * top, rows * times)
    codes = torch.where(scales[:, None] == 0, 0.0, torch.round(scaled))
    codes = codes.flatten()[: x.numel()]
    return codes.to(torch.int8 if signed else torch.uint8), scales
    # END LAB 4.4


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """(codes, scales) -> fp32: code x (1 / top) x its block's scale, the kernel's two fp32 products in its order:
    top x (1 / top) is exactly 1 in fp32, so the top code decodes to the scale itself and a block decoded and
    encoded again keeps its scale and codes bit for bit."""
    # Rounded once in fp32, as the C constant is.
    step = torch.tensor(1.0) / (M_TOP if signed else V_TOP)
    per_element = scales.repeat_interleave(BLOCK)[: codes.numel()]
    return codes.to(torch.float32) * step * per_element


def encode_moments(m: torch.Tensor, v: torch.Tensor, precision: str) -> dict[str, torch.Tensor]:
    """fp32 moments -> the tensors of `precision`, under cpu_adam_update's keyword names."""
    if precision == "fp32":
        return {"exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    if precision == "bf16":
        return {"exp_avg": round_to_bf16(m).to(torch.uint16), "exp_avg_sq": round_to_bf16(v).to(torch.uint16)}
    if precision == "int8":
        m_codes, m_scales = quantize_blocks(m, signed=True)
        v_codes, v_scales = quantize_blocks(square_root(v), signed=False)
        return {
            "exp_avg": m_codes,
            "exp_avg_sq": v_codes,
            "exp_avg_scale": m_scales,
            "exp_avg_sq_scale": v_scales,
        }
    raise ValueError(f"moment precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def decode_moments(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors encode_moments returns (or the kernel updated) -> fp32 (m, v)."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.dtype == torch.float32:
        return m.clone(), v.clone()
    if "exp_avg_scale" in state:
        root = dequantize_blocks(v, state["exp_avg_sq_scale"], signed=False)
        return dequantize_blocks(m, state["exp_avg_scale"], signed=True), root * root
    return bf16_bits_to_float(m), bf16_bits_to_float(v)


def zeros_state(n: int, precision: str) -> dict[str, torch.Tensor]:
    """The moments of a first step (all zero) in `precision`."""
    return encode_moments(torch.zeros(n), torch.zeros(n), precision)


# ------------------------------------------------------------------------------------------ the reference
def reference_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = False,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """One step of the kernel's scalar loop in torch, on copies: returns (new param, new state in the state's
    precision, the rounded weights or None). Every operation is one fp32 operation, in the kernel's order,
    with the hyperparameters derived in double precision and rounded once, as cpu_adam_update does."""
    precision = _precision_of(state)
    beta1, beta2 = betas

    def f32(value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float32)

    step_size = f32(lr / (1 - beta1**step) if bias_correction else lr)
    bc2_sqrt = f32(math.sqrt(1 - beta2**step) if bias_correction else 1.0)
    m, v = decode_moments(state)
    w = param.clone()
    g = grad.to(torch.float32) * f32(grad_scale)
    if weight_decay != 0.0:
        if adamw:
            w = w * f32(1 - lr * weight_decay)
        else:
            g = g + f32(weight_decay) * w
    m = f32(beta1) * m + f32(1 - beta1) * g
    v = f32(beta2) * v + f32(1 - beta2) * (g * g)
    denom = divide(square_root(v), bc2_sqrt.expand_as(v)) + f32(eps)
    w = w - step_size * divide(m, denom)
    out = None if out_dtype is None else w.to(out_dtype)
    return w, encode_moments(m, v, precision), out


def _precision_of(state: dict[str, torch.Tensor]) -> str:
    if state["exp_avg"].dtype == torch.float32:
        return "fp32"
    return "int8" if "exp_avg_scale" in state else "bf16"
