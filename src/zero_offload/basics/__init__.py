"""Module 1 (basics 基础篇): naive Adam/AdamW, mixed-precision model states, loss scaling, memory accounting,
the gradient norm."""

from .adam import Adam, adam_update, update_moments
from .memory import MemoryLedger, MemoryReport, ModelStateBytes, estimate_model_states
from .norm import global_norm, squared_norm
from .precision import DynamicLossScaler, MixedPrecisionStates, StaticLossScaler, has_overflow

__all__ = [
    "Adam",
    "adam_update",
    "update_moments",
    "MemoryLedger",
    "MemoryReport",
    "ModelStateBytes",
    "estimate_model_states",
    "DynamicLossScaler",
    "StaticLossScaler",
    "MixedPrecisionStates",
    "has_overflow",
    "global_norm",
    "squared_norm",
]
