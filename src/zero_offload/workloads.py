"""The course's workload: a tiny GPT and a byte-level corpus made from the course's own text.

Nothing is downloaded. The model's size is one config, from under a million parameters to over a billion;
`GPTConfig.num_params()` counts them without building the model, so plans for 13B models cost nothing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 64
    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    tie_weights: bool = True  # the output head reuses the embedding, as GPT-2 does

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")

    def num_params(self) -> int:
        """Exact parameter count: embeddings, 12 d^2 + 13 d per block, final norm, untied head if any."""
        d = self.d_model
        embeddings = self.vocab_size * d + self.seq_len * d
        head = 0 if self.tie_weights else self.vocab_size * d
        return embeddings + self.n_layer * (12 * d * d + 13 * d) + 2 * d + head


# Named sizes used by the lessons, the demo and the benchmarks.
PRESETS = {
    "nano": GPTConfig(seq_len=32, d_model=64, n_layer=2, n_head=2),  # ~0.12M: unit tests
    "tiny": GPTConfig(),  # ~0.84M: lessons, demo
    "small": GPTConfig(seq_len=128, d_model=256, n_layer=6, n_head=8),  # ~4.8M
    "10m": GPTConfig(seq_len=128, d_model=384, n_layer=6, n_head=6),  # ~10.8M: DESIGN.md's benchmark size
    "100m": GPTConfig(seq_len=128, d_model=768, n_layer=14, n_head=12),  # ~99M
    # ~1.02B: module 5's largest model; 36 narrower blocks rather than 20 wide ones, so that one block (57 MB in
    # bf16) and its neighbours fit a 512 MB device at stage 3.
    "1b": GPTConfig(seq_len=128, d_model=1536, n_layer=36, n_head=12),
}


def gpt_config(name_or_config: str | GPTConfig, **overrides) -> GPTConfig:
    if isinstance(name_or_config, GPTConfig):
        return replace(name_or_config, **overrides)
    if name_or_config not in PRESETS:
        raise ValueError(f"unknown model preset {name_or_config!r}; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name_or_config], **overrides)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class TinyGPT(nn.Module):
    """A GPT-2-style byte-level language model; `forward(idx)` returns logits of shape (B, T, vocab)."""

    def __init__(self, cfg: GPTConfig | str = "tiny", *, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg = gpt_config(cfg)
        # Built without memory, then each weight is made once, in `dtype`: a 1B-parameter model in bf16 never
        # holds a 4 GB fp32 copy, nor spends time on torch's default initialisation that ours replaces.
        with torch.device("meta"):
            self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights(seed, dtype)

    @torch.no_grad()
    def _init_weights(self, seed: int, dtype: torch.dtype) -> None:
        # Its own generator: the same seed gives the same weights on every rank, whatever else used the RNG.
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)  # GPT-2: scale the residual projections
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                value = torch.zeros(param.shape)
            elif param.dim() == 1:  # LayerNorm weight
                value = torch.ones(param.shape)
            else:
                std = residual_std if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                value = torch.randn(param.shape, generator=gen) * std
            owner, _, attr = name.rpartition(".")
            setattr(self.get_submodule(owner), attr, nn.Parameter(value.to(dtype)))  # from meta to memory
        if self.cfg.tie_weights:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        expected = f"expected shape (batch, seq_len) of token ids, seq_len at most {self.cfg.seq_len}"
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            got = f"shape {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__
            fix = "; make one sequence a batch of one with idx[None]" if got.count(",") == 1 else ""
            raise ValueError(f"TinyGPT: {expected}, got {got}{fix}")
        if idx.numel() == 0:  # its mean loss is 0/0: a NaN that the step would train on
            raise ValueError(f"TinyGPT: the batch is empty (shape {tuple(idx.shape)}); pass at least one sequence "
                             "of at least one token")  # fmt: skip
        seq = idx.shape[1]
        if seq > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {seq} tokens is longer than the model's seq_len {self.cfg.seq_len}"
            )
        pos = torch.arange(seq, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy, computed in fp32 whatever the logits' precision. The targets follow the logits
    to their device: a batch is made on the CPU, and the engine moves only what the forward takes."""
    targets = targets.to(logits.device)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


CORPUS_SNAPSHOT = Path(__file__).resolve().parent / "data" / "corpus.txt"
_FENCED = re.compile(rb"^```.*?^```[^\n]*\n?", re.MULTILINE | re.DOTALL)
_DIGITS = re.compile(rb"[0-9]")


def course_prose(root: str | Path) -> bytes:
    """The prose of the Markdown chapters under `root`/course: fenced blocks and digits are left out, as they
    hold what the lessons print and measure (see load_corpus)."""
    files = sorted((Path(root) / "course").glob("*.md"))
    if not files:
        raise FileNotFoundError(f"no course/*.md under {root}")
    return b"\n".join(_DIGITS.sub(b"", _FENCED.sub(b"", f.read_bytes())) for f in files)


def load_corpus(root: str | Path | None = None) -> torch.Tensor:
    """The training text, as a uint8 tensor: a snapshot of the course's prose (data/corpus.txt), or with `root`
    the prose of the chapters under root/course as they are now.

    The lessons train on the snapshot, so that editing a chapter (which quotes the lessons' numbers) does not
    change the numbers the lessons print. `python tools/make_corpus.py` takes a new snapshot; every lesson's
    numbers change with it.
    """
    data = course_prose(root) if root is not None else CORPUS_SNAPSHOT.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class ByteBatches:
    """Deterministic next-byte batches: the same (step, seed) gives the same batch on every machine.

    A step's global batch has `batch_size` rows. `micro_batch` cuts it in rank order: micro-step k of rank r
    holds rows [(k * world_size + r) * micro, ... + micro), so any world size and accumulation sees the same
    global batch.
    """

    def __init__(self, corpus: torch.Tensor, seq_len: int, *, seed: int = 0, split: str = "train"):
        cut = int(len(corpus) * 0.9)
        self.data = corpus[:cut] if split == "train" else corpus[cut:]
        if len(self.data) <= seq_len + 1:
            raise ValueError(
                f"the {split} corpus ({len(self.data)} bytes) is too short for seq_len {seq_len}"
            )
        self.seq_len, self.seed = seq_len, seed

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - self.seq_len - 1, (batch_size,), generator=gen)
        rows = torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()]).long()
        return rows[:, :-1], rows[:, 1:]

    def micro_batch(
        self,
        step: int,
        micro: int,
        *,
        micro_step: int = 0,
        rank: int = 0,
        world_size: int = 1,
        accumulation: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (0 <= micro_step < accumulation and 0 <= rank < world_size):
            raise ValueError(
                f"micro_step {micro_step} / rank {rank} out of range ({accumulation} x {world_size})"
            )
        x, y = self.global_batch(step, micro * accumulation * world_size)
        first = (micro_step * world_size + rank) * micro
        return x[first : first + micro], y[first : first + micro]
