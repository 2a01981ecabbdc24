"""`zo train`: train the tiny GPT with any config, on one process or under torchrun, on one node or several.

    zo train --config ds_config.json --model tiny --steps 200 --eval-every 50 --save-every 50
    zo train --config ds_config.json --model tiny --steps 200 --save-every 50 --resume    # after a failure
    torchrun --nproc_per_node 2 -m zero_offload.cli train --config ds_config.json
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 1 --master_addr HOST --master_port 29500 \\
             -m zero_offload.cli train --config ds_config.json                            # and node_rank 1

This file is the loop: checkpoints to resume from, steps, evaluations, saves, and the report. The run it
drives (engine, data, history) is training_run.py; the checks on the options, arguments.py; what
happens when a rank is lost, lost_rank.py. Rank 0 shows a progress bar and writes the report under --out
(run_dir.py), with the last steps' timeline as a chart (timeline.png) and as a trace to open in
ui.perfetto.dev or chrome://tracing (trace.json).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from ...engine.divergence import TrainingDivergedError
from ...principles.process_group import init_distributed
from . import run_dir
from .arguments import TrainError, check_arguments, check_same_arguments
from .lost_rank import RankLostError, StoppedBySigterm, lost_a_rank, lost_message, sigterm_raises
from .training_run import TrainingRun

__all__ = ["RankLostError", "TrainError", "train"]


def train(
    config_path: str,
    *,
    model: str = "tiny",
    steps: int = 100,
    out: str = "out/train",
    seed: int = 0,
    eval_every: int = 0,
    eval_batches: int = 4,
    save_every: int = 0,
    keep: int = 2,
    resume: bool = False,
    timeout: float | None = None,
) -> dict:
    """Train, evaluate and checkpoint as the options say; rank 0 writes the report. Returns the summary."""
    check_arguments(config_path, steps, eval_every, eval_batches, save_every, keep, timeout)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        init_distributed(timeout_s=timeout)
    run = None
    with sigterm_raises(distributed):
        try:
            if distributed:
                check_same_arguments(
                    model=model,
                    steps=steps,
                    out=out,
                    seed=seed,
                    eval_every=eval_every,
                    eval_batches=eval_batches,
                    save_every=save_every,
                    keep=keep,
                    resume=resume,
                    timeout=timeout,
                )
            run = TrainingRun(config_path, model, seed, eval_batches)
            summary = _train(run, steps, Path(out), eval_every, save_every, keep, resume)
        except TrainingDivergedError:
            raise  # every rank saw the same inf/nan and stops with the same message: no rank was lost
        except (RuntimeError, StoppedBySigterm) as err:
            if distributed and lost_a_rank(err):
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's SIGTERM must not cut the message
                raise RankLostError(lost_message(err, run, Path(out))) from err
            raise
        except ValueError:  # input refused (arguments, config, model that differ by rank), on every rank
            if distributed:
                dist.destroy_process_group()  # else gloo's threads outlive the interpreter: SIGABRT at exit
            raise
    run.engine.close()
    if distributed:
        dist.destroy_process_group()
    return summary


def _train(
    run: TrainingRun, steps: int, out: Path, eval_every: int, save_every: int, keep: int, resume: bool
) -> dict:
    engine = run.engine
    comm, rank0 = engine.comm, engine.comm.rank == 0
    newest, found = run_dir.scan(out, comm)
    if resume:
        if newest is None:
            raise TrainError(
                f"--resume: there is no complete checkpoint under {out / run_dir.CHECKPOINTS}; pass the --out of "
                "the run to continue, or train without --resume (with --save-every N to save checkpoints)"
            )
        run.resume(newest)
        if run.step >= steps:
            raise TrainError(
                f"{newest} is at step {run.step} and --steps is {steps}: nothing is left to "
                f"train; pass a --steps above {run.step}"
            )
        if rank0:  # the unfinished checkpoints of the run that died
            run_dir.remove(out, lambda step: step > run.step)
    elif found:
        raise TrainError(
            f"{out / run_dir.CHECKPOINTS} holds {found} checkpoint(s) of an earlier run: pass --resume to continue "
            "it, or another --out to start afresh"
        )
    resumed_at = run.step if resume else None
    say = tqdm.write if rank0 else (lambda text: None)
    if resume:
        say(f"resumed from {newest}: continuing at step {run.step + 1}")
    desc = f"training ({comm.world_size} rank(s), stage {run.config.zero_optimization.stage})"
    with tqdm(total=steps, initial=run.step, desc=desc, unit="step", disable=not rank0) as bar:
        while run.step < steps:
            loss = run.train_step()
            bar.update(1)
            bar.set_postfix({"loss": f"{loss:.3f}", "tokens/s": f"{run.history['tokens_per_s'][-1]:,.0f}"})
            last = run.step == steps
            if eval_every and (run.step % eval_every == 0 or last):
                say(f"step {run.step}: eval loss {run.evaluate():.4f} ({run.eval_batches} held-out batches)")
            if save_every and (run.step % save_every == 0 or last):
                run.now_doing(f"the checkpoint after step {run.step}")
                say(f"step {run.step}: saved {run_dir.save(engine, out, run.history, keep)}")
    run.now_doing("the final report")
    engine.timeline(  # every rank; rank 0 draws the chart and writes the trace
        out / "timeline.png", title=f"the last steps of {comm.world_size} rank(s)", trace=out / "trace.json"
    )
    return _report(run, out, resumed_at)


def _report(run: TrainingRun, out: Path, resumed_at: int | None) -> dict:
    engine, history = run.engine, run.history
    this_run = history["step_ms"][resumed_at or 0 :]
    transfers = engine.states.transfers  # None unless offloaded: nothing crosses PCIe
    report = engine.memory_report()
    summary = {
        "model": history["model"],
        "world_size": engine.comm.world_size,
        "nodes": _nodes(engine.comm.world_size),
        "stage": run.config.zero_optimization.stage,
        "params": engine.num_params,
        "steps": run.step,
        "resumed_at": resumed_at,
        "ms_per_step": sum(this_run) / len(this_run),  # this process's steps
        "tokens_per_step": run.tokens_per_step,
        "losses": history["losses"],
        "eval_losses": history["eval"],
        "step_ms": history["step_ms"],
        "tokens_per_s": history["tokens_per_s"],
        "skipped_steps": engine.skipped_steps,
        "traffic_elements": dict(engine.comm.elements),
        # Bytes across PCIe, each way, this rank: the ZeRO-Offload paper's 2 + 2 per parameter.
        "pcie_bytes": dict(transfers.bytes) if transfers is not None else {},
        "memory": {
            "estimated": report.estimated.as_dict(),
            "measured": report.measured.as_dict(),
            "device_peak": report.device.peak,
            "host_staging": report.host_staging,
        },
        "checkpoints": [path.name for _, path in run_dir.checkpoints(out)],
    }
    if engine.comm.rank == 0:
        print(report)
        losses = history["losses"]
        print(
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {summary['ms_per_step']:.0f} ms/step; "
            f"{engine.skipped_steps} step(s) skipped (inf/nan); "
            f"collectives moved {sum(engine.comm.elements.values()):,} elements per rank"
        )
        files = run_dir.write_report(out, summary, report, title=f"{history['model']} GPT on the course text")
        print("wrote " + ", ".join(str(path) for path in [*files, out / "timeline.png", out / "trace.json"]))
    return summary


def _nodes(world_size: int) -> int:
    """Nodes of the job: torchrun's GROUP_WORLD_SIZE (one agent a node), else ranks / ranks per node."""
    if "GROUP_WORLD_SIZE" in os.environ:
        return int(os.environ["GROUP_WORLD_SIZE"])
    return max(1, world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
