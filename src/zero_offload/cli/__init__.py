"""The `zo` command and the applications behind it: everything here uses the engine, nothing below uses this.

  main.py          `zo`: one subcommand per module below, each with its options beside what it runs
  arguments.py     the argument types they share (a parameter count, a byte size)
  estimate.py      `zo estimate`: model-state bytes per tier
  plan.py          `zo plan`: the performance model and the advisor's choice for a machine and a model
  check_config.py  `zo check-config`: a config, read as the engine reads it
  checkpoint.py    `zo checkpoint to-fp32`: a checkpoint's fp32 weights for plain PyTorch
  launch.py        torchrun, with its rendezvous store on the loopback address alone
  train/           `zo train`: the training application
  demo/            `zo demo` (`make demo`)
  bench/           `zo bench` (`make bench`) and the experiments it runs
  grade/           `zo grade` (`make labN`): the labs, the grading run, its pytest plugin and report, labkit

`python -m zero_offload.cli` and the `zo` script both run `main`.
"""

from .main import main

__all__ = ["main"]
