"""A user's model made ready for the engine: the same on every rank, and what is not model state on the device.

Model states (trainable parameters, their gradients, the optimizer's) are the states objects' business. The rest
of a model also lives on the device: its buffers (masks, running statistics) and its frozen parameters, in the
precision forward computes in; forward's inputs go there too. On a device that stores fp16/bf16 but computes in
fp32 (the emulated one), each layer's weights are upcast just before the layer runs. Last, what backward checks
of the loss it is given, and of the calls around it.
"""

from __future__ import annotations

import warnings

import torch

from ..accelerator import Accelerator, HintOnOutOfMemory
from ..principles.comm import Comm


def check_same_parameters(comm: Comm, model: torch.nn.Module) -> None:
    """Fail on every rank, naming the first parameter that differs, unless every rank trains the same shapes.

    The configs agree by now, but a model built from another argument on one rank would send buffers of other
    sizes into the first collective, where gloo aborts the process or every rank waits for the timeout."""
    if comm.world_size == 1:
        return
    mine = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
    everyone = [None] * comm.world_size
    torch.distributed.all_gather_object(everyone, mine, group=comm.group)
    first_rank = everyone[0]
    for rank, theirs in enumerate(everyone):
        if theirs == first_rank:
            continue
        at = next((i for i, (a, b) in enumerate(zip(first_rank, theirs, strict=False)) if a != b), None)
        at = min(len(theirs), len(first_rank)) if at is None else at  # one list is the start of the other
        shown = [
            f"{p[at][0]} of shape {p[at][1]}" if at < len(p) else "missing" for p in (first_rank, theirs)
        ]
        raise ValueError(
            f"the ranks train different models: trainable parameter {at} is {shown[0]} on rank 0 but {shown[1]} "
            f"on rank {rank} ({len(first_rank)} and {len(theirs)} trainable parameters); build the same model "
            "on every rank (same size, same layers, same requires_grad)"
        )


def resident_dtype(
    tensor: torch.Tensor, accelerator: Accelerator, storage_dtype: torch.dtype, *, parameter: bool
) -> torch.dtype:
    """The dtype a buffer (`parameter=False`) or a frozen parameter keeps on the device.

    Integer and bool tensors, and every tensor of an fp32 run, keep their own dtype. In an fp16/bf16 run a
    frozen parameter is stored like the trained ones (the upcast hooks give it the compute precision where that
    differs: the emulated device), and a floating-point buffer, which no hook upcasts, takes the compute dtype.
    """
    if not tensor.is_floating_point() or storage_dtype == torch.float32:
        return tensor.dtype
    return storage_dtype if parameter else accelerator.compute_dtype(storage_dtype)


def place_buffers_and_frozen(model: torch.nn.Module, accel: Accelerator, storage_dtype: torch.dtype) -> None:
    """Buffers and frozen parameters follow the model to the device, in the precision forward computes in: a
    GPU run would otherwise meet fp32 or host tensors among its fp16 ones. Frozen parameters are no model state
    (no gradient, no Adam, not sharded), but device memory all the same: charged as parameters."""
    for buf in model.buffers():
        # Not through accel.empty (the emulated device charges no buffers), but a GPU's OOM still gets the hint.
        with HintOnOutOfMemory("parameters"):
            buf.data = buf.data.to(accel.device, resident_dtype(buf, accel, storage_dtype, parameter=False))
    frozen = {id(p): p for p in model.parameters() if not p.requires_grad}
    for param in frozen.values():
        dtype = resident_dtype(param, accel, storage_dtype, parameter=True)
        resident = accel.empty(param.shape, dtype, category="parameters")
        param.data = resident.copy_(param.data)


def install_upcast_hooks(model: torch.nn.Module, accel: Accelerator) -> None:
    """Compute in fp32 on a device that stores fp16/bf16: each layer's weights are upcast just before use.

    The fp32 copy is differentiable, so its gradient flows back into the fp16 `.grad`, exactly where a GPU
    computing in fp16 would put it. The copies are marked as artefacts, not charged to the device.
    """

    # Per module, while its forward runs: (owner, name, stored parameter) of each weight swapped for its fp32 copy.
    stored: dict[int, list] = {}

    def upcast(module, args):
        swapped = stored[id(module)] = []
        # nn.MultiheadAttention reads out_proj's weights without calling out_proj: upcast them here too.
        owners = [module, module.out_proj] if isinstance(module, torch.nn.MultiheadAttention) else [module]
        for owner in owners:
            for name, param in owner._parameters.items():
                if param is not None and param.dtype != torch.float32:
                    compute = param.to(torch.float32)
                    accel.mark_compute_copy(compute, param)
                    swapped.append((owner, name, param))
                    owner._parameters[name] = compute

    def restore(module, args, output):
        for owner, name, param in stored.pop(id(module), ()):
            owner._parameters[name] = param

    for module in model.modules():
        if any(p is not None for p in module._parameters.values()):
            module.register_forward_pre_hook(upcast)
            module.register_forward_hook(restore, always_call=True)


def to_device(value, accel: Accelerator, storage_dtype: torch.dtype):
    """Forward's inputs on the device, floating-point ones in the compute dtype; nested lists, tuples, dicts."""
    if isinstance(value, torch.Tensor):
        value = value.to(accel.device)
        if value.is_floating_point():
            value = value.to(accel.compute_dtype(storage_dtype))
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, accel, storage_dtype) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, accel, storage_dtype) for k, v in value.items()}
    return value


def check_loss(loss) -> None:
    """What backward needs: the scalar loss tensor the forward returned."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"backward needs the loss tensor returned by the forward, got {type(loss).__name__}; pass "
            "the loss itself (e.g. loss_fn(engine(x), y)), not loss.item() or a number"
        )
    if loss.dim() != 0:
        raise ValueError(
            f"backward needs a scalar loss, got shape {tuple(loss.shape)}; reduce it first (mean)"
        )


def warn_unstepped(accumulation_steps: int) -> None:
    warnings.warn(
        f"backward() was called again after {accumulation_steps} backward() call(s) with no engine.step() "
        "between: the gradients add up over more micro-batches than gradient_accumulation_steps says, so the "
        "next step is larger than intended; call engine.step() after every backward(), or raise "
        "gradient_accumulation_steps",
        UserWarning,
        stacklevel=3,
    )
