"""The `zo` command and the applications behind it: everything here uses the engine, nothing below uses this.

  main.py      `zo`: the parser and the dispatch to each command
  plan.py      `zo plan`: the performance model and the advisor's choice for a machine and a model
  launch.py    torchrun, with its rendezvous store on the loopback address alone
  train/       `zo train` and `zo checkpoint`: the training application
  demo/        `zo demo` (`make demo`)
  bench/       `zo bench` (`make bench`) and the experiments it runs
  grade/       `zo grade` (`make labN`): the labs, the grading run, its pytest plugin and report, labkit

`python -m zero_offload.cli` and the `zo` script both run `main`.
"""

from .main import main

__all__ = ["main"]
