"""One `zo train` run: the engine, its data, and the history of every step so far (restored on resume).

Each rank takes its rows of every global batch, in rank order (workloads.ByteBatches), and batch `step` is a
function of the step alone, so any world size sees the same data and a resumed run continues the same sequence.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from ...config import load_config
from ...engine import initialize
from ...implementation.checkpoint import CheckpointError
from ...workloads import ByteBatches, TinyGPT, gpt_config, lm_loss, load_corpus
from . import run_dir


class TrainingRun:
    """One training run: the engine, its data, and the history of every step so far (restored on resume)."""

    def __init__(self, config_path: str, model: str, seed: int, eval_batches: int):
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.config = load_config(config_path, world_size=world_size)
        cfg = gpt_config(model)
        self.engine = initialize(TinyGPT(cfg, seed=seed), self.config)
        corpus = load_corpus()
        self.data = ByteBatches(corpus, cfg.seq_len, seed=seed)
        self.held_out = ByteBatches(corpus, cfg.seq_len, seed=seed, split="val")
        self.eval_batches = eval_batches
        self.tokens_per_step = self.config.train_batch_size * cfg.seq_len
        self.history = {
            "model": model,
            "seed": seed,
            "losses": [],
            "step_ms": [],
            "tokens_per_s": [],
            "eval": [],
        }
        self.step = 0  # steps done; the one in progress is step + 1
        self.doing = "start-up"  # what the ranks were doing together, for the error if one is lost

    def _micro_batches(self, data: ByteBatches, index: int):
        """This rank's micro-batches of global batch `index`."""
        accumulation, comm = self.config.gradient_accumulation_steps, self.engine.comm
        for k in range(accumulation):
            yield data.micro_batch(
                index,
                self.config.train_micro_batch_size_per_gpu,
                micro_step=k,
                rank=comm.rank,
                world_size=comm.world_size,
                accumulation=accumulation,
            )

    def now_doing(self, what: str) -> None:
        """What the ranks do together from now on (a checkpoint, the report): named if a rank is lost during it."""
        self.doing = what

    def train_step(self) -> float:
        self.doing = f"step {self.step + 1}"
        start, total = time.perf_counter(), 0.0
        accumulation = self.config.gradient_accumulation_steps
        for x, y in self._micro_batches(self.data, self.step):
            loss = lm_loss(self.engine(x), y)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.item() / accumulation
        # The logged loss is the global batch's: the mean over ranks of each rank's mean.
        loss = self.engine.comm.sum(total) / self.engine.comm.world_size
        seconds = time.perf_counter() - start
        self.history["losses"].append(loss)
        self.history["step_ms"].append(seconds * 1e3)
        self.history["tokens_per_s"].append(self.tokens_per_step / seconds)
        self.step += 1
        return loss

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean loss over the same `eval_batches` global batches of held-out text each time."""
        self.doing = f"the evaluation after step {self.step}"
        total, count = 0.0, 0
        for index in range(self.eval_batches):
            for x, y in self._micro_batches(self.held_out, index):
                total += lm_loss(self.engine(x), y).item()
                count += 1
        loss = self.engine.comm.sum(total / count) / self.engine.comm.world_size
        self.history["eval"].append({"step": self.step, "loss": loss})
        return loss

    def resume(self, path: Path) -> None:
        history = run_dir.load_history(path)
        for flag in ("model", "seed"):
            if history[flag] != self.history[flag]:
                raise CheckpointError(
                    f"the checkpoint {path} was trained with --{flag} {history[flag]}, this run has --{flag} "
                    f"{self.history[flag]}: resume with --{flag} {history[flag]} (the same model and data "
                    "order), or train afresh into another --out"
                )
        self.engine.load_checkpoint(path)
        self.step = self.engine.global_steps
        self.history = history
