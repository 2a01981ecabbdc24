"""The engine's own settings, all under the top-level key "zero_offload" so that a DeepSpeed config stays one.

Every key is optional; a section that sets them all reads:

    "zero_offload": {
        "device_memory": "512MiB",          # budget of the emulated device (int bytes or a size string)
        "cpu_adam": {"impl": "simd", "threads": 2, "variant": "fastest", "states": "fp32"},
                                            # the host's Adam: "simd" | "torch" | "naive"; the C kernel's loop:
                                            # "fastest" (measured once) | "widest" | "scalar" | "avx2" | "avx512";
                                            # its m and v: "fp32" | "bf16" | "int8" (8-bit codes, block scales)
        "overlap_offload": true,            # module 5: copies and the host's Adam overlap the device's work
        "staging_slots": 4,                 # its host staging buffers per direction (default 2: double-buffered)
        "delayed_param_update": {"enabled": true, "start_step": 40},
        "cores": {"device": [0], "host": [1]},  # pin the device's compute and the host's Adam apart
        "max_skipped_steps": 20             # stop after this many steps in a row skipped for inf/nan
    }
"""

from __future__ import annotations

import json
import os

from zero_offload.units import parse_bytes

from .reader import AT_LEAST_1, NON_NEGATIVE, Section
from .schema import ConfigError, CoresConfig, CpuAdamConfig, DelayedParamUpdateConfig, ExtensionConfig

# Keys this section once had that no longer do anything; a config that still has them loads with a warning.
# "seed" never reached the model: its initial weights come from the script (e.g. `zo train --seed`).
_IGNORED_EXTENSION = ("seed",)


def read_extension(s: Section) -> ExtensionConfig:
    device_memory = s.data.pop("device_memory", None) if s.has("device_memory") else None
    if device_memory is not None:
        try:
            device_memory = parse_bytes(device_memory)
        except ValueError as err:
            raise ConfigError(s.key("device_memory"), f"{s.key('device_memory')}: {err}") from None
        if device_memory <= 0:
            raise ConfigError(s.key("device_memory"), f"{s.key('device_memory')} must be more than 0 bytes")
    s.ignore(*_IGNORED_EXTENSION)
    adam, delayed = s.section("cpu_adam"), s.section("delayed_param_update")
    out = ExtensionConfig(
        device_memory=device_memory,
        cpu_adam=CpuAdamConfig(
            impl=adam.choice("impl", ("simd", "torch", "naive"), "simd"),
            threads=adam.get("threads", int, None, optional=True, **AT_LEAST_1),
            variant=adam.choice("variant", ("fastest", "widest", "scalar", "avx2", "avx512"), "fastest"),
            states=adam.choice("states", ("fp32", "bf16", "int8"), "fp32"),
        ),
        overlap_offload=s.get("overlap_offload", bool, False),
        staging_slots=s.get("staging_slots", int, 2, **AT_LEAST_1),
        max_skipped_steps=s.get("max_skipped_steps", int, 20, **AT_LEAST_1),
        delayed_param_update=DelayedParamUpdateConfig(
            enabled=delayed.get("enabled", bool, False),
            start_step=delayed.get("start_step", int, 40, **NON_NEGATIVE),
        ),
        cores=_cores(s.section("cores")),
    )
    for section in (adam, delayed, s):
        section.done()
    return out


def _cores(s: Section) -> CoresConfig:
    # All of the machine's cores, not this thread's affinity: an engine made earlier may have pinned this thread.
    usable = list(range(os.cpu_count() or 1)) if hasattr(os, "sched_setaffinity") else []
    picked = {}
    for side in ("device", "host"):
        cores = s.get(side, list, [])
        if cores and not usable:
            raise ConfigError(
                s.key(side), f"{s.key(side)}: this system cannot pin threads to cores; remove it"
            )
        bad = [c for c in cores if not isinstance(c, int) or isinstance(c, bool) or c not in usable]
        if bad:
            raise ConfigError(
                s.key(side),
                f"{s.key(side)} = {json.dumps(cores)}: {json.dumps(bad)} not among this machine's cores "
                f"(0 to {len(usable) - 1})",
            )
        picked[side] = tuple(cores)
    s.done()
    shared = set(picked["device"]) & set(picked["host"])
    if shared:
        raise ConfigError(
            s.key("host"),
            f"{s.key('device')} and {s.key('host')} share core(s) {sorted(shared)}; give each side its own "
            "cores, or leave both lists out to let them share all cores",
        )
    return CoresConfig(**picked)
