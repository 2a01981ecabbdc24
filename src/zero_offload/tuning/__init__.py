"""Module 4 (tuning 调优篇): a SIMD CPU Adam in C bound with cffi."""

from .cpu_adam import CPUAdam, cpu_adam_update

__all__ = ["CPUAdam", "cpu_adam_update"]
