"""zero_offload: a small, readable ZeRO-Offload training engine and the course built around it.

import zero_offload as zo
engine = zo.initialize(model, "ds_config.json")
loss = loss_fn(engine(x), y)
engine.backward(loss)
engine.step()
print(engine.memory_report())
"""

from .engine import Engine, initialize
from .principles.stage3_leaves import GatherOrderError

__all__ = ["Engine", "GatherOrderError", "initialize"]
__version__ = "0.1.0"
