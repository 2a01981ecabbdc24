"""`zo train`: train the tiny GPT with any config, on one process or under torchrun.

    zo train --config ds_config.json --model tiny --steps 200
    torchrun --nproc_per_node 2 -m zero_offload.cli train --config ds_config.json

Each rank takes its rows of every global batch, in rank order (workloads.ByteBatches), so any world size sees
the same data. Rank 0 shows a progress bar and writes the loss history and a plot under --out.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .. import initialize
from ..config import load_config
from ..plots import plot_losses
from ..principles.comm import init_distributed
from ..workloads import ByteBatches, TinyGPT, gpt_config, lm_loss, load_corpus


def train(
    config_path: str, *, model: str = "tiny", steps: int = 100, out: str = "out/train", seed: int = 0
) -> dict:
    comm = init_distributed() if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    rank = comm.rank if comm else 0
    world_size = comm.world_size if comm else 1
    config = load_config(config_path, world_size=world_size)
    cfg = gpt_config(model)
    engine = initialize(TinyGPT(cfg, seed=seed), config)
    data = ByteBatches(load_corpus(), cfg.seq_len, seed=seed)
    micro, accumulation = config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
    losses = []
    started = time.perf_counter()
    with tqdm(
        range(steps),
        desc=f"training ({world_size} rank(s), stage {config.zero_optimization.stage})",
        unit="step",
        disable=rank != 0,
    ) as bar:
        for step in bar:
            total = 0.0
            for k in range(accumulation):
                x, y = data.micro_batch(
                    step, micro, micro_step=k, rank=rank, world_size=world_size, accumulation=accumulation
                )
                loss = lm_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                total += loss.item() / accumulation
            # The logged loss is the global batch's: the mean over ranks of each rank's mean.
            losses.append(engine.comm.sum(total) / world_size)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - started
    summary = {
        "world_size": world_size,
        "stage": config.zero_optimization.stage,
        "params": engine.num_params,
        "steps": steps,
        "ms_per_step": seconds / max(steps, 1) * 1000,
        "losses": losses,
        "skipped_steps": engine.skipped_steps,
        "traffic_elements": dict(engine.comm.elements),
        # Bytes across PCIe, each way, this rank (offload only): the ZeRO-Offload paper's 2 + 2 per parameter.
        "pcie_bytes": dict(getattr(engine.states, "transfers", None).bytes)
        if hasattr(engine.states, "transfers")
        else {},
    }
    report = engine.memory_report()
    if rank == 0:
        out_dir = Path(out)
        out_dir.mkdir(parents=True, exist_ok=True)
        print(report)
        print(
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {summary['ms_per_step']:.0f} ms/step; "
            f"collectives moved {sum(engine.comm.elements.values()):,} elements per rank"
        )
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
        plot_losses(
            {f"stage {summary['stage']}, {world_size} rank(s)": losses},
            out_dir / "loss.png",
            title="Tiny GPT on the course text",
        )
    if comm is not None:
        torch.distributed.destroy_process_group()
    return summary
