"""Module 3 (implementation 实现篇): CPU offload of the optimizer step, and DeepSpeed's learning-rate schedules."""

from .schedulers import LRScheduler, build_scheduler, lr_at

__all__ = ["LRScheduler", "build_scheduler", "lr_at"]
