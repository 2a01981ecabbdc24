"""Combinations of settings the engine refuses, each with the key to change and how.

The readers (sections.py, extension.py, load.py) check each setting on its own and what DeepSpeed itself rejects;
these are the combinations this engine cannot run, or that would run and silently help nobody. `zo.initialize` and
`zo check-config` both apply them, so a config the CLI calls OK is one the engine runs.
"""

from __future__ import annotations

from .schema import Config


def check_supported(config: Config) -> None:
    """Raise NotImplementedError listing every key of `config` the engine cannot honour, each with the fix."""
    zero = config.zero_optimization
    problems = []
    if zero.offload_param.device == "nvme":
        problems.append(
            (
                "zero_optimization.offload_param.device",
                'parameters on NVMe are not supported, only the optimizer\'s states; use "device": "cpu" here '
                'and keep "offload_optimizer": {"device": "nvme"}',
            )
        )
    if zero.offload_optimizer.device == "nvme" and zero.offload_optimizer.ratio < 1.0:
        problems.append(
            (
                "zero_optimization.offload_optimizer.ratio",
                "a partial offload keeps some states on the device, the NVMe tier all of them in files; keep "
                'ratio 1.0 with "device": "nvme", or use "device": "cpu" for a partial offload',
            )
        )
    if zero.offload_optimizer.ratio < 1.0 and zero.offload_param.enabled:
        problems.append(
            (
                "zero_optimization.offload_optimizer.ratio",
                "a partial offload updates some weights on the device, so they must live there; with "
                'offload_param keep ratio 1.0, or set "offload_param": {"device": "none"}',
            )
        )
    if zero.offload_param.enabled and not zero.offload_optimizer.enabled:
        problems.append(
            (
                "zero_optimization.offload_param",
                "offloading the fp16 weights while the fp32 master weights and moments (6x their size) stay on "
                'the device saves the least memory for the most traffic; add "offload_optimizer": {"device": "cpu"}',
            )
        )
    problems += _moment_problems(config)
    problems += _module5_problems(config)
    if problems:
        lines = "\n".join(f"  {key}: {why}" for key, why in problems)
        raise NotImplementedError(f"zero_offload cannot run this config:\n{lines}")


def _moment_problems(config: Config) -> list[tuple[str, str]]:
    """Moments below fp32 (module 4) live with the host's C Adam, the one Adam that reads and writes them."""
    zero, adam = config.zero_optimization, config.zero_offload.cpu_adam
    if adam.states == "fp32":
        return []
    key = "zero_offload.cpu_adam.states"
    if zero.stage == 0 or not zero.offload_optimizer.enabled:
        return [(key, f'"{adam.states}" moments are the host\'s: they need "zero_optimization": {{"stage": 1, 2 '
                 'or 3, "offload_optimizer": {"device": "cpu"}} (or "nvme"); or keep "states": "fp32"')]  # fmt: skip
    if adam.impl != "simd":
        return [(key, f'only the C Adam runs "{adam.states}" moments; set "cpu_adam": {{"impl": "simd"}}, or '
                 f'keep "states": "fp32" with "impl": "{adam.impl}"')]  # fmt: skip
    return []


def _module5_problems(config: Config) -> list[tuple[str, str]]:
    """The overlapped pipeline and the delayed update work on the host's half of an offloaded optimizer."""
    zero, ext, problems = config.zero_optimization, config.zero_offload, []
    offloaded = zero.stage > 0 and zero.offload_optimizer.enabled
    needs_offload = (
        "it overlaps the host's Adam with the device's work, so it needs "
        '"zero_optimization": {"stage": 1, 2 or 3, "offload_optimizer": {"device": "cpu"}}'
    )
    if ext.overlap_offload and not offloaded:
        problems.append(("zero_offload.overlap_offload", needs_offload))
    if ext.staging_slots != 2 and not ext.overlap_offload:
        problems.append(("zero_offload.staging_slots", "only the overlapped pipeline stages through slots; "
                         'set "overlap_offload": true, or remove staging_slots'))  # fmt: skip
    dpu = ext.delayed_param_update.enabled
    if dpu and not offloaded:
        problems.append(("zero_offload.delayed_param_update", needs_offload))
    if dpu and offloaded and zero.offload_param.enabled:
        problems.append((
            "zero_offload.delayed_param_update",
            "with offload_param the host's weights are what the next forward gathers, and the delayed Adam "
            'would be rewriting them; use one or the other ("offload_param": {"device": "none"})',
        ))  # fmt: skip
    if dpu and offloaded and zero.offload_optimizer.ratio < 1.0:
        problems.append((
            "zero_offload.delayed_param_update",
            "a partial offload updates its device units at once and would mix stale and fresh weights; "
            "keep offload_optimizer.ratio at 1.0",
        ))  # fmt: skip
    if zero.offload_optimizer.device == "nvme":
        for key, on in (("overlap_offload", ext.overlap_offload), ("delayed_param_update", dpu)):
            if on:
                problems.append((
                    f"zero_offload.{key}",
                    "the NVMe tier steps one sub-group at a time with its own read-ahead and write-behind "
                    'threads; use it with "offload_optimizer": {"device": "cpu"}, or turn it off',
                ))  # fmt: skip
    if ext.cores.host and not offloaded:
        problems.append(("zero_offload.cores.host", "the host's cores run the offloaded Adam; there is none "
                         'without "offload_optimizer": {"device": "cpu"}; remove cores.host'))  # fmt: skip
    return problems
