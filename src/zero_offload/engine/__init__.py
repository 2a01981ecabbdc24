"""The composition: the pieces of the five modules put together into the engine `zero_offload.initialize` returns.

The files:
  engine.py          `Engine` and `initialize`: forward, backward, step, checkpoints, reports
  states.py          `build_states`: where the model states live, the states object the config picks
  optimizer_step.py  `OptimizerStep`: who runs Adam, when, and on which cores
  optimizers.py      which Adam updates which fp32 masters
  model_setup.py     a user's model made ready for the engine
  divergence.py      non-finite values never reach the master weights; a run that keeps skipping stops
The engine imports modules 1-5; none of them imports it.
"""

from .engine import Engine, initialize

__all__ = ["Engine", "initialize"]
