"""DeepSpeed's entry points over this engine: a DeepSpeed training script runs with one import changed.

    import zero_offload.deepspeed as deepspeed

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())   # --deepspeed, --deepspeed_config
    args = parser.parse_args()
    deepspeed.init_distributed()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=dataset)

Each call means what DeepSpeed's means, for the subset this engine supports; an argument it cannot honour (a
model-parallel `mpu`, a client optimizer or scheduler object) is refused with an error that says what to
write instead. The README's "Coming from DeepSpeed" lists what maps one to one and what differs.
"""

from __future__ import annotations

from . import zero
from .entry import add_config_arguments, init_distributed, initialize

__all__ = ["add_config_arguments", "init_distributed", "initialize", "zero"]
