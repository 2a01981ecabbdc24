"""The stages of a training step and one span of work: what the timeline records (timeline.py) and its pictures
draw (timeline_plots.py). The stages are listed in the order a step runs them; timeline.py says what each is.
"""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("forward", "backward", "reduce", "D2H", "NVMe read", "Adam", "NVMe write", "H2D", "all-gather")
# The stages whose work a GPU queues and runs later: on CUDA they are timed by events, the others by the host.
DEVICE_STAGES = frozenset({"forward", "backward", "reduce", "D2H", "H2D", "all-gather"})


@dataclass(frozen=True)
class Span:
    stage: str
    step: int  # the optimizer step this work belongs to (engine.global_steps while it ran)
    start: float  # seconds since the timeline was made
    end: float
