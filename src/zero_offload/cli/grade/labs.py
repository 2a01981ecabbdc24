"""The labs: for each, its module, its title and its tasks with their points.

The task ids are the ones of the lab markers in src/ (`# BEGIN LAB 1.2`), of the course pages and of the graded
tests' `@pytest.mark.task("1.2")`, so a learner can grep between them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    id: str
    title: str
    points: int


@dataclass(frozen=True)
class Lab:
    number: int
    module: str
    title: str  # starts with the module's Chinese name, as the course pages do
    available: bool
    tasks: tuple[Task, ...]


LABS: dict[int, Lab] = {lab.number: lab for lab in (
    Lab(1, "basics", "基础篇 basics: naive Adam, mixed precision, model-state memory", True, (
        Task("1.1", "Adam moment updates", 25),
        Task("1.2", "Bias correction and the parameter update, Adam vs AdamW", 25),
        Task("1.3", "Model-state bytes per tier", 25),
        Task("1.4", "Loss-scale overflow handling", 25))),
    Lab(2, "principles", "原理篇 principles: ZeRO stage 1/2/3 sharding", True, (
        Task("2.1", "Shard ranges", 25),
        Task("2.2", "Reduce-scatter into the owned shard", 25),
        Task("2.3", "All-gather of updated parameters", 25),
        Task("2.4", "Stage-3 gather and release around a layer", 25))),
    Lab(3, "implementation", "实现篇 implementation: CPU offload of the optimizer step", True, (
        Task("3.1", "Copy the gradient partition to the host fp32 buffer", 25),
        Task("3.2", "The offloaded Adam step over the flat partition", 25),
        Task("3.3", "Cast and upload the updated weights", 25),
        Task("3.4", "Overflow across ranks: skip everywhere, lose nothing", 25))),
    Lab(4, "tuning", "调优篇 tuning: a SIMD CPU Adam kernel in C, Adam's moments in 8 bits", True, (
        Task("4.1", "The AVX2 FMA loop in fp32", 28),
        Task("4.2", "The fp16 weight output with F16C", 24),
        Task("4.3", "The scalar tail", 24),
        Task("4.4", "Blockwise 8-bit codes of the moments", 24))),
    Lab(5, "practice", "实战篇 practice: overlapped transfers, delayed parameter update", True, (
        Task("5.1", "The double-buffered bucket schedule", 34),
        Task("5.2", "Event ordering so no buffer is overwritten early", 33),
        Task("5.3", "Delayed parameter update", 33))),
)}  # fmt: skip
