"""Shared test settings."""

from __future__ import annotations

import os

import torch

# The suite runs on the emulated device even where CUDA exists; a GPU test asks for CUDA itself (ZO_DEVICE=cuda).
os.environ.setdefault("ZO_DEVICE", "cpu")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one xdist worker per core; a worker's torch using every core as well makes the two
    # thread pools fight over them (measured: tiny steps ran 8x slower on two busy cores than on one).
    torch.set_num_threads(1)
