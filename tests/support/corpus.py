"""A fixed corpus for tests: the course text changes as chapters are written, and tests must not move with it."""

from __future__ import annotations

import random

import torch

_WORDS = (
    "the gpu computes while the cpu stores optimizer states and pcie moves fp16 gradients down and fp16 "
    "parameters up each step adam reads the master weight momentum and variance then writes them back"
).split()


def fixed_corpus(num_bytes: int = 60_000, seed: int = 0) -> torch.Tensor:
    """Sentences of the course's vocabulary in a seeded order, as a uint8 tensor like load_corpus()."""
    rng = random.Random(seed)
    text, size = [], 0
    while size < num_bytes:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 12))) + ". "
        text.append(sentence)
        size += len(sentence)
    return torch.frombuffer(bytearray("".join(text)[:num_bytes].encode()), dtype=torch.uint8)
