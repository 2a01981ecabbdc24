"""Which Adam updates which fp32 masters: chosen from the config, with its moments in the states' own buffers.

`zero_offload.cpu_adam.impl` picks the host's Adam when the optimizer is offloaded: "simd" (module 4's C Adam,
the default), "torch" (torch's fused Adam, module 3) or "naive" (module 1's). States on the device are always
updated by torch's fused Adam (or module 1's naive one, when that is the choice). With module 4's partial
offload there are two optimizers: one for the host's units, one for the units kept on the device.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..basics.adam import Adam
from ..config import Config
from ..tuning.build import CPUAdamUnavailable
from ..tuning.cpu_adam import CPUAdam, default_threads, supported_variants
from ..tuning.partial import SplitOptimizer
from ..tuning.variant_choice import fastest_variant
from .param_groups import ParamGroups


def build_optimizer(
    config: Config,
    params: list,
    exp_avgs: list,
    exp_avg_sqs: list,
    impl: str | None = None,
    *,
    groups: ParamGroups | None = None,
    master_groups: list[int] | None = None,
    scales: tuple[list, list] | None = None,
):
    """The Adam that updates the fp32 `params`, with its moments living in the buffers the states allocated.

    `impl` defaults to the config's zero_offload.cpu_adam.impl ("simd", "torch" or "naive"). With parameter
    `groups`, `master_groups` says the group of each of `params`; the optimizer has the script's groups, in
    its order, each with its own settings (None: one group, the config's). `scales`: the int8 moments' block
    scales, (exp_avg's, exp_avg_sq's) per param (None entries, or None: moments without scales)."""
    opt, impl = config.optimizer, impl or config.zero_offload.cpu_adam.impl
    kwargs = dict(lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay)
    scales = scales or ([None] * len(params), [None] * len(params))
    moments = {id(m): (a, b, *s) for m, a, b, *s in zip(params, exp_avgs, exp_avg_sqs, *scales, strict=True)}
    narrow = bool(exp_avgs) and exp_avgs[0].dtype != torch.float32  # module 4's bf16 or int8 moments
    if groups is not None:  # the settings come with each group; the keyword ones are only the defaults
        params = groups.torch_groups(params, master_groups)
    # Module 4's C Adam, if chosen (None where it cannot be built and the moments are fp32: a fallback below).
    optimizer = simd_optimizer(config, params, kwargs, narrow) if impl == "simd" else None
    if optimizer is None and impl == "naive":
        optimizer = Adam(params, adamw=opt.adamw, **kwargs)
    elif optimizer is None:
        if not opt.bias_correction:
            raise ValueError(
                'optimizer.params.bias_correction=false needs "zero_offload": '
                '{"cpu_adam": {"impl": "naive"}}; torch.optim.Adam always corrects the bias'
            )
        cls = torch.optim.AdamW if opt.adamw else torch.optim.Adam
        optimizer = cls(params, fused=True, **kwargs)
    # Filled in before the first step, so the optimizer never allocates moments of its own behind our back.
    for param in (p for group in optimizer.param_groups for p in group["params"]):
        exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale = moments[id(param)]
        state = {"step": torch.zeros((), dtype=torch.float32, device=param.device)}
        state.update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        if exp_avg_scale is not None:  # int8 moments: their blocks' scales, which the C Adam rewrites too
            state.update(exp_avg_scale=exp_avg_scale, exp_avg_sq_scale=exp_avg_sq_scale)
        optimizer.state[param] = state
    return optimizer


def host_adam_threads(config: Config) -> int | None:
    """The C Adam's threads: the config's zero_offload.cpu_adam.threads; else, when module 5 gives the host
    cores of its own (zero_offload.cores.host), one per core; else None (cpu_adam.py's default)."""
    cores, threads = config.zero_offload.cores, config.zero_offload.cpu_adam.threads
    if threads is None and cores.host:
        return len(cores.host)
    return threads


def kernel_variant(configured: str, threads: int | None, precision: str = "fp32") -> str:
    """The C kernel's loop for zero_offload.cpu_adam.variant: "fastest" is measured on this machine once for
    these threads and moments (tuning/variant_choice.py), "widest" is the kernel's own "auto", a name is itself."""
    if configured == "fastest":
        return fastest_variant(threads or default_threads(), supported_variants(), precision)
    return "auto" if configured == "widest" else configured


def simd_optimizer(config: Config, params: list, kwargs: dict, narrow: bool = False):
    """The C CPU Adam (module 4), or None, with one warning, where no C compiler can build it. With `narrow`
    moments (bf16 or int8, which only the C Adam reads) there is nothing to fall back to: an error."""
    opt, adam = config.optimizer, config.zero_offload.cpu_adam
    try:
        return CPUAdam(
            params,
            adamw=opt.adamw,
            bias_correction=opt.bias_correction,
            threads=host_adam_threads(config),
            variant=kernel_variant(adam.variant, host_adam_threads(config), adam.states),
            **kwargs,
        )
    except CPUAdamUnavailable as err:
        if narrow:
            raise CPUAdamUnavailable(
                f'{err}. zero_offload.cpu_adam.states is "{adam.states}", and only the C Adam stores moments '
                'below fp32: make the C Adam build (a C compiler and cffi), or set "states": "fp32"'
            ) from None
        warnings.warn(f"{err}. Falling back to torch.optim's fused Adam for now.", stacklevel=4)
        return None


@dataclass
class Optimizers:
    """The engine's optimizers: `optimizer` (what the lr schedule drives), the host's and the device's part."""

    optimizer: torch.optim.Optimizer
    host: torch.optim.Optimizer | None  # over the first `split` units (every unit when nothing stays behind)
    device: torch.optim.Optimizer | None  # module 4's partial offload: the units kept on the device
    split: int


def build_optimizers(config: Config, states, groups: ParamGroups, *, offloaded: bool) -> Optimizers:
    """One Adam over every master partition; with a partial offload, one on the host and one on the device.
    Each has the parameter `groups` (engine/param_groups.py), over the masters of its own units."""
    impl = config.zero_offload.cpu_adam.impl
    device_impl = "naive" if impl == "naive" else "torch"
    host_impl = impl if offloaded else device_impl
    lists = (
        states.master_params,
        states.exp_avgs,
        states.exp_avg_sqs,
        states.master_groups,
        states.exp_avg_scales,
        states.exp_avg_sq_scales,
    )

    def build(part: slice, part_impl: str):
        masters, exp_avgs, exp_avg_sqs, master_groups, m_scales, v_scales = (x[part] for x in lists)
        return build_optimizer(
            config, masters, exp_avgs, exp_avg_sqs, part_impl, groups=groups, master_groups=master_groups,
            scales=(m_scales, v_scales),
        )  # fmt: skip

    # The first optimizer's units: the host's when offloaded (all but module 4's device units), else all.
    split = states.host_units if offloaded else len(states.master_params)
    if split == len(states.master_params):
        host = build(slice(None), host_impl)
        return Optimizers(host, host, None, split)
    host = build(slice(None, split), host_impl) if split else None
    device = build(slice(split, None), device_impl)
    return Optimizers(SplitOptimizer(host, device), host, device, split)
