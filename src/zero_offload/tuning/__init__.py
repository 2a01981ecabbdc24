"""Module 4 (tuning 调优篇): a SIMD CPU Adam in C bound with cffi."""

from .cpu_adam import CPUAdam, adam_update

__all__ = ["CPUAdam", "adam_update"]
