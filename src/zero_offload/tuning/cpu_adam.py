"""`CPUAdam`: Adam/AdamW over CPU tensors, backed by the C kernel in csrc/cpu_adam.c (bound with cffi).

Two levels:
  cpu_adam_update(...)  one pass over flat tensors: reads fp32/fp16/bf16 gradients, applies a gradient factor
                    (1 / loss scale x clip factor), updates the fp32 master weights and Adam's moments in place,
                    and can write the fp16/bf16 copy of the weights in the same pass; the moments may be stored
                    in fp32, bf16 or 8 bits (state_precision.py);
  CPUAdam           a torch.optim.Optimizer built on it, a drop-in for torch.optim.Adam/AdamW on the host.

Every tensor is checked before the C code touches any memory: a wrong dtype, device, length or layout is a
ValueError that names the tensor and the fix.
"""

from __future__ import annotations

import math
import os

import torch

# `row_squares` has the rows of basics/norm.py's squared_norm; NORM_ROW is re-exported for the kernel's callers.
from ..basics.norm import NORM_ROW, norm_rows, squared_norm_of_rows  # noqa: F401
from ..implementation.offload import HostAdam
from .build import build
from .state_precision import BLOCK, blocks

GRAD_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
VARIANTS = {"auto": -1, "scalar": 0, "avx2": 1, "avx512": 2}
# How the moments are stored, by their dtypes (ZO_STATE_* in cpu_adam.h): int8 moments come with scales.
STATE_FP32, STATE_BF16, STATE_INT8 = 0, 1, 2
BF16_BITS = (torch.bfloat16, torch.uint16)
MOMENT_DTYPES = (torch.float32, *BF16_BITS, torch.int8, torch.uint8)


def supported_variants() -> list[str]:
    """The kernel variants this CPU can run ("scalar" always; "avx2", "avx512" on x86-64 CPUs that have them)."""
    mask = build().lib.zo_cpu_variants()
    return [name for name, bit in VARIANTS.items() if bit >= 0 and mask & (1 << bit)]


def dispatched_variant() -> str:
    """The variant "auto" runs on this CPU: the widest it supports, as zo_adam_update chooses."""
    return supported_variants()[-1]


def default_threads() -> int:
    """Threads for the C kernel: ZO_CPU_ADAM_THREADS, else the cores torch is allowed to use."""
    return int(os.environ.get("ZO_CPU_ADAM_THREADS", 0)) or torch.get_num_threads()


def _check(name: str, tensor: torch.Tensor, n: int, dtypes) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} is on {tensor.device}; the CPU Adam reads host memory: move it with .cpu()")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(tensor.dtype).replace('torch.', '')}; it must be {allowed}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass .contiguous() (a flat buffer or a slice of one)")
    if tensor.numel() != n:
        raise ValueError(f"{name} has {tensor.numel()} elements but the weights have {n}; lengths must match")


def cpu_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw: bool = False,
    bias_correction: bool = True,
    grad_scale: float = 1.0,
    out: torch.Tensor | None = None,
    variant: str = "auto",
    threads: int | None = None,
    row_squares: torch.Tensor | None = None,
    exp_avg_scale: torch.Tensor | None = None,
    exp_avg_sq_scale: torch.Tensor | None = None,
) -> None:
    """One Adam step (the `step`-th, counting from 1) over flat CPU tensors, in one pass; see the module doc.

    `row_squares` (fp32, `norm_rows(n)` elements): filled in the same pass with the sum of (grad x grad_scale)^2
    over each row of NORM_ROW elements, for the gradient norm (`squared_norm_of_rows`).

    The moments' dtypes say how they are stored (state_precision.py): fp32; bf16 (torch.bfloat16, or its bits
    as torch.uint16); or int8 codes, exp_avg torch.int8 and exp_avg_sq torch.uint8 (codes of sqrt v), with
    `exp_avg_scale` and `exp_avg_sq_scale`, fp32, one per block of 2048 elements (`blocks(n)`). The fp32
    master weights stay fp32; the codes and scales are replaced by the new moments'."""
    _check_all(param, grad, exp_avg, exp_avg_sq, out, moments=MOMENT_DTYPES)
    state_dtype = _state_dtype(exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale)
    if row_squares is not None:
        _check("row_squares", row_squares, norm_rows(param.numel()), (torch.float32,))
    if step < 1:
        raise ValueError(f"step counts from 1 (the first update), got {step}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    module = build()
    ffi, lib = module.ffi, module.lib
    beta1, beta2 = betas
    args = _tensor_args(ffi, param, grad, exp_avg, exp_avg_sq, out)
    if state_dtype != STATE_FP32:
        args.state_dtype = state_dtype
        args.exp_avg, args.exp_avg_sq = ffi.NULL, ffi.NULL
        args.exp_avg_packed = ffi.cast("void *", exp_avg.data_ptr())
        args.exp_avg_sq_packed = ffi.cast("void *", exp_avg_sq.data_ptr())
    if state_dtype == STATE_INT8:
        args.exp_avg_scale = ffi.cast("float *", exp_avg_scale.data_ptr())
        args.exp_avg_sq_scale = ffi.cast("float *", exp_avg_sq_scale.data_ptr())
    args.adamw = int(adamw)
    # Everything derived from the hyperparameters is computed here in double precision, then rounded once.
    args.beta1, args.one_minus_beta1, args.beta2, args.one_minus_beta2 = beta1, 1 - beta1, beta2, 1 - beta2
    args.eps, args.weight_decay, args.decay = eps, weight_decay, 1 - lr * weight_decay
    args.step_size = lr / (1 - beta1**step) if bias_correction else lr
    args.bias_correction2_sqrt = math.sqrt(1 - beta2**step) if bias_correction else 1.0
    args.grad_scale = grad_scale
    if row_squares is not None:
        args.row_squares = ffi.cast("float *", row_squares.data_ptr())
    status = lib.zo_adam_update(args, VARIANTS[variant], threads or default_threads())
    if status == -2:  # a lab 4 stub ran: say which task, as the Python labs do
        raise NotImplementedError(ffi.string(lib.zo_missing_lab()).decode())
    if status != 0:
        raise ValueError(f"this CPU cannot run the {variant!r} variant; use 'auto' or 'scalar'")


def memory_floor(
    param,
    grad,
    exp_avg,
    exp_avg_sq,
    *,
    out=None,
    threads: int | None = None,
    exp_avg_scale=None,
    exp_avg_sq_scale=None,
    nontemporal: bool = False,
) -> None:
    """Move the bytes of one Adam pass with no arithmetic, as a yardstick for timing an update: fp32 gradients
    and no output (28 bytes a parameter), or 16-bit gradients and a 16-bit output (the one-pass offload update,
    also 28). With moments stored narrow (the dtypes and scales cpu_adam_update takes), the bytes of that
    precision's pass: 16-bit gradients and output only (20 bytes a parameter in bf16, about 16 in int8). The
    tensors are scratch: their values are overwritten with meaningless ones. `nontemporal` writes with streaming
    stores, which skip the cache (AVX2 CPUs only; elsewhere a ValueError): time both, the faster is the floor."""
    _check_all(param, grad, exp_avg, exp_avg_sq, out, moments=MOMENT_DTYPES)
    state_dtype = _state_dtype(exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale)
    if (grad.dtype == torch.float32) != (out is None) or (out is not None and out.dtype == torch.float32):
        raise ValueError("the floor is defined for fp32 gradients without an output, or 16-bit gradients with "
                         "a 16-bit output")  # fmt: skip
    if state_dtype != STATE_FP32 and out is None:
        raise ValueError("the floor of narrow moments is defined for 16-bit gradients with a 16-bit output")
    module = build()
    args = _tensor_args(module.ffi, param, grad, exp_avg, exp_avg_sq, out)
    if state_dtype != STATE_FP32:
        args.state_dtype = state_dtype
        args.exp_avg_packed = module.ffi.cast("void *", exp_avg.data_ptr())
        args.exp_avg_sq_packed = module.ffi.cast("void *", exp_avg_sq.data_ptr())
    if state_dtype == STATE_INT8:
        args.exp_avg_scale = module.ffi.cast("float *", exp_avg_scale.data_ptr())
        args.exp_avg_sq_scale = module.ffi.cast("float *", exp_avg_sq_scale.data_ptr())
    if module.lib.zo_memory_floor(args, threads or default_threads(), int(nontemporal)) == -2:
        raise ValueError("streaming stores need a CPU with AVX2: time the floor with nontemporal=False")


def _check_all(param, grad, exp_avg, exp_avg_sq, out, moments=(torch.float32,)) -> None:
    n = param.numel() if isinstance(param, torch.Tensor) else -1
    _check("param", param, n, (torch.float32,))
    _check("grad", grad, n, tuple(GRAD_DTYPES))
    _check("exp_avg", exp_avg, n, moments)
    _check("exp_avg_sq", exp_avg_sq, n, moments)
    if out is not None:
        _check("out", out, n, tuple(GRAD_DTYPES))


def _state_dtype(exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale) -> int:
    """The moments' storage from their dtypes (already among MOMENT_DTYPES), or a ValueError with the fix."""
    m, v = exp_avg.dtype, exp_avg_sq.dtype
    if m == torch.uint8:
        raise ValueError("exp_avg (Adam's m) is signed: its 8-bit codes must be torch.int8, not torch.uint8")
    if v == torch.int8:
        raise ValueError(
            "exp_avg_sq holds 8-bit codes of sqrt(v), which is never negative: it must be torch.uint8, not "
            "torch.int8"
        )
    if m == v == torch.float32 or (m in BF16_BITS and v in BF16_BITS):
        for name, scale in (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)):
            if scale is not None:
                raise ValueError(f"{name} is only for 8-bit moments (torch.int8 / torch.uint8); pass None")
        return STATE_FP32 if m == torch.float32 else STATE_BF16
    if (m, v) != (torch.int8, torch.uint8):
        names = {
            torch.float32: "fp32",
            torch.int8: "int8",
            torch.uint8: "int8",
            **dict.fromkeys(BF16_BITS, "bf16"),
        }
        raise ValueError(
            f"exp_avg is {names[m]} but exp_avg_sq is {names[v]}: both moments must have one precision "
            "(fp32 and fp32, bf16 and bf16, or torch.int8 and torch.uint8 codes)"
        )
    want = blocks(exp_avg.numel())
    for name, scale in (("exp_avg_scale", exp_avg_scale), ("exp_avg_sq_scale", exp_avg_sq_scale)):
        if scale is None:
            raise ValueError(
                f"8-bit moments need {name}: an fp32 tensor of {want} elements, one per block of {BLOCK} "
                "(state_precision.zeros_state(n, 'int8') makes a first step's)"
            )
        if isinstance(scale, torch.Tensor) and scale.numel() != want:
            raise ValueError(
                f"{name} has {scale.numel()} elements; 8-bit moments of {exp_avg.numel()} elements need "
                f"{want}, one per block of {BLOCK} (state_precision.blocks(n))"
            )
        _check(name, scale, want, (torch.float32,))
    return STATE_INT8


def _tensor_args(ffi, param, grad, exp_avg, exp_avg_sq, out):
    """A zo_adam_args with the pointers, length and dtypes filled in (the hyperparameters left at zero)."""
    args = ffi.new("zo_adam_args *")
    args.param = ffi.cast("float *", param.data_ptr())
    args.grad = ffi.cast("void *", grad.data_ptr())
    args.exp_avg = ffi.cast("float *", exp_avg.data_ptr())
    args.exp_avg_sq = ffi.cast("float *", exp_avg_sq.data_ptr())
    args.out = ffi.NULL if out is None else ffi.cast("void *", out.data_ptr())
    args.n = param.numel()
    args.grad_dtype = GRAD_DTYPES[grad.dtype]
    args.out_dtype = 0 if out is None else GRAD_DTYPES[out.dtype]
    return args


class CPUAdam(torch.optim.Optimizer):
    """Adam (`adamw=False`, L2 decay) or AdamW over fp32 CPU tensors, one C pass per tensor per step."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adamw: bool = True,
        bias_correction: bool = True,
        threads: int | None = None,
        variant: str = "auto",
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw,
                        bias_correction=bias_correction)  # fmt: skip
        super().__init__(params, defaults)
        self.threads, self.variant = threads, variant
        self._groups_table: tuple = (None, {})  # group_of's: the groups' sizes it was made for, id -> group
        build()  # compile now, not in the middle of the first step
        if variant != "auto" and variant not in supported_variants():
            raise ValueError(
                f"this CPU cannot run the {variant!r} variant of the C Adam (it runs "
                f"{', '.join(supported_variants())}); set zero_offload.cpu_adam.variant to one of them, or to 'fastest'"
            )

    def group_of(self, param: torch.Tensor) -> dict:
        """The param group that holds `param`, whose settings its update uses."""
        # Looked up once per unit and step: a table, made again if a group was added since.
        sizes = tuple(len(group["params"]) for group in self.param_groups)
        if self._groups_table[0] != sizes:
            table = {id(p): index for index, group in enumerate(self.param_groups) for p in group["params"]}
            self._groups_table = (sizes, table)
        index = self._groups_table[1].get(id(param))
        if index is None:
            raise KeyError(
                f"a tensor of shape {tuple(param.shape)} is in none of this optimizer's param groups"
            )
        return self.param_groups[index]

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                cpu_adam_update(
                    param, param.grad, state["exp_avg"], state["exp_avg_sq"],
                    step=int(state["step"]), lr=group["lr"], betas=group["betas"], eps=group["eps"],
                    weight_decay=group["weight_decay"], adamw=group["adamw"],
                    bias_correction=group["bias_correction"], variant=self.variant, threads=self.threads,
                    exp_avg_scale=state.get("exp_avg_scale"), exp_avg_sq_scale=state.get("exp_avg_sq_scale"),
                )  # fmt: skip
        return loss


def one_pass_update(
    optimizer: CPUAdam, master, grad, out, clip_factor: float, *, norm: bool = False
) -> float | None:
    """One unit of the offloaded step in one pass: Adam on `master` (one of the optimizer's parameters) and, in
    the same pass, its fp16/bf16 copy written into `out` (None: fp32 training, the master is the copy).

    `norm`: also return the gradient's squared norm (times clip_factor squared), summed on the way."""
    group, state = optimizer.group_of(master), optimizer.state[master]
    state["step"] += 1
    rows = torch.empty(norm_rows(master.numel()), dtype=torch.float32) if norm else None
    cpu_adam_update(
        master, grad, state["exp_avg"], state["exp_avg_sq"],
        step=int(state["step"]), lr=group["lr"], betas=group["betas"], eps=group["eps"],
        weight_decay=group["weight_decay"], adamw=group["adamw"], bias_correction=group["bias_correction"],
        grad_scale=clip_factor, out=out, variant=optimizer.variant, threads=optimizer.threads, row_squares=rows,
        exp_avg_scale=state.get("exp_avg_scale"), exp_avg_sq_scale=state.get("exp_avg_sq_scale"),
    )  # fmt: skip
    return squared_norm_of_rows(rows) if norm else None


def one_pass_offload_step(
    states, optimizer: CPUAdam, grads: list[torch.Tensor], clip_factor: float, units=None, *, norms=None
) -> bool:
    """The offloaded step of module 3 in one pass per unit: Adam on the host partition and, in the same pass,
    the weights written into the staging buffers publish() uploads (no separate cast pass).

    `units` (indices) limits it to some units: the NVMe tier steps one sub-group at a time. `norms` (a list):
    each unit's squared gradient norm is appended to it, summed in the same pass. Returns True: the staging
    buffers hold the rounded weights, for publish(rounded=True)."""
    # The optimizer's parameters are the host's units, which come first (tuning/partial.py).
    masters = states.master_params[: sum(len(group["params"]) for group in optimizer.param_groups)]
    if len(grads) != len(masters):
        raise ValueError(f"{len(grads)} gradients for {len(masters)} master partitions; pass one per unit")
    for index in range(len(masters)) if units is None else units:
        staging = states.param_staging[index]
        out = None if staging.data_ptr() == masters[index].data_ptr() else staging
        squares = one_pass_update(
            optimizer, masters[index], grads[index], out, clip_factor, norm=norms is not None
        )
        if norms is not None:
            norms.append(squares)
    return True


class OnePassAdam(HostAdam):
    """Module 4's host Adam: the C kernel's one pass per unit reads the gradient in its own precision, updates
    the fp32 master and moments, writes the fp16/bf16 weights publish uploads, and sums the norm."""

    rounds_in_pass = True
    reads_low_precision_grads = True
    sums_norm = True

    def step(self, states, grads: list[torch.Tensor], clip_factor: float, units=None, norms=None) -> bool:
        return one_pass_offload_step(states, self.optimizer, grads, clip_factor, units, norms=norms)

    def update(self, master, grad, out, clip_factor: float, *, norm=False) -> float | None:
        return one_pass_update(self.optimizer, master, grad, out, clip_factor, norm=norm)


def host_adam(optimizer: torch.optim.Optimizer) -> HostAdam:
    """The host's Adam for `optimizer`: module 4's one-pass update for the C Adam, module 3's otherwise."""
    return OnePassAdam(optimizer) if isinstance(optimizer, CPUAdam) else HostAdam(optimizer)
