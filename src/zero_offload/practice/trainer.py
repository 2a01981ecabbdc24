"""`zo train`: train the tiny GPT with any config, on one process or under torchrun, on one node or several.

    zo train --config ds_config.json --model tiny --steps 200 --eval-every 50 --save-every 50
    zo train --config ds_config.json --model tiny --steps 200 --save-every 50 --resume    # after a failure
    torchrun --nproc_per_node 2 -m zero_offload.cli train --config ds_config.json
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 1 --master_addr HOST --master_port 29500 \\
             -m zero_offload.cli train --config ds_config.json                            # and node_rank 1

Each rank takes its rows of every global batch, in rank order (workloads.ByteBatches), and batch `step` is a
function of the step alone, so any world size sees the same data and a resumed run continues the same sequence.
Rank 0 shows a progress bar and writes the report under --out (practice/run_dir.py).

A rank that dies takes the job down: the others cannot finish a collective without it. They stop at once (or,
for a rank that hangs, after --timeout seconds) with an error that names the step and the checkpoint that
`--resume` continues from.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import initialize
from ..config import load_config
from ..divergence import TrainingDivergedError
from ..implementation.checkpoint import CheckpointError
from ..principles.comm import CommunicationError, init_distributed
from ..workloads import ByteBatches, TinyGPT, gpt_config, lm_loss, load_corpus
from . import run_dir


class TrainError(ValueError):
    """A command line that cannot run as given; the message says what to change."""


class RankLostError(RuntimeError):
    """Another rank died or stopped answering, so this one cannot go on; the message says how to resume."""


class _Stopped(Exception):  # not a RuntimeError: Comm would report it as a failed collective
    """SIGTERM: torchrun sends it to the other ranks of a node when one of them has failed."""


class _Run:
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
            yield data.micro_batch(index, self.config.train_micro_batch_size_per_gpu, micro_step=k,
                                   rank=comm.rank, world_size=comm.world_size, accumulation=accumulation)  # fmt: skip

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


def train(config_path: str, *, model: str = "tiny", steps: int = 100, out: str = "out/train", seed: int = 0,
          eval_every: int = 0, eval_batches: int = 4, save_every: int = 0, keep: int = 2,
          resume: bool = False, timeout: float | None = None) -> dict:  # fmt: skip
    """Train, evaluate and checkpoint as the options say; rank 0 writes the report. Returns the summary."""
    _check_arguments(config_path, steps, eval_every, eval_batches, save_every, keep, timeout)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        init_distributed(timeout_s=timeout)
    run = None
    with _sigterm_raises(distributed):
        try:
            if distributed:
                _check_same_arguments(model=model, steps=steps, out=out, seed=seed, eval_every=eval_every,
                                      eval_batches=eval_batches, save_every=save_every, keep=keep,
                                      resume=resume, timeout=timeout)  # fmt: skip
            run = _Run(config_path, model, seed, eval_batches)
            summary = _train(run, steps, Path(out), eval_every, save_every, keep, resume)
        except TrainingDivergedError:
            raise  # every rank saw the same inf/nan and stops with the same message: no rank was lost
        except (RuntimeError, _Stopped) as err:
            if distributed and _lost_a_rank(err):
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's SIGTERM must not cut the message
                raise RankLostError(_lost_message(err, run, Path(out))) from err
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
    run: _Run, steps: int, out: Path, eval_every: int, save_every: int, keep: int, resume: bool
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
            raise TrainError(f"{newest} is at step {run.step} and --steps is {steps}: nothing is left to "
                             f"train; pass a --steps above {run.step}")  # fmt: skip
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
                run.doing = f"the checkpoint after step {run.step}"
                say(f"step {run.step}: saved {run_dir.save(engine, out, run.history, keep)}")
    run.doing = "the final report"
    engine.timeline(out / "timeline.png", title=f"the last steps of {comm.world_size} rank(s)")  # every rank
    return _report(run, out, resumed_at)


def _report(run: _Run, out: Path, resumed_at: int | None) -> dict:
    engine, history = run.engine, run.history
    this_run = history["step_ms"][resumed_at or 0 :]
    transfers = getattr(engine.states, "transfers", None)  # offload only
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
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {summary['ms_per_step']:.0f} ms/step; "
              f"{engine.skipped_steps} step(s) skipped (inf/nan); "
              f"collectives moved {sum(engine.comm.elements.values()):,} elements per rank")  # fmt: skip
        files = run_dir.write_report(out, summary, report, title=f"{history['model']} GPT on the course text")
        print("wrote " + ", ".join(str(path) for path in [*files, out / "timeline.png"]))
    return summary


def _nodes(world_size: int) -> int:
    """Nodes of the job: torchrun's GROUP_WORLD_SIZE (one agent a node), else ranks / ranks per node."""
    if "GROUP_WORLD_SIZE" in os.environ:
        return int(os.environ["GROUP_WORLD_SIZE"])
    return max(1, world_size // int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))


def _check_arguments(config_path, steps, eval_every, eval_batches, save_every, keep, timeout) -> None:
    path = Path(config_path)
    if not path.is_file():
        why = "is a directory" if path.is_dir() else "does not exist"
        raise TrainError(f"config file {config_path} {why}; pass --config with the path of a DeepSpeed-style "
                         "JSON file (`zo check-config FILE` checks one)")  # fmt: skip
    least = {"--steps": (steps, 1), "--eval-every": (eval_every, 0), "--eval-batches": (eval_batches, 1),
             "--save-every": (save_every, 0), "--keep": (keep, 1)}  # fmt: skip
    problems = [
        f"{flag} must be at least {low}, got {value}" for flag, (value, low) in least.items() if value < low
    ]
    if timeout is not None and timeout <= 0:
        problems.append(f"--timeout is seconds, more than 0, got {timeout}")
    if problems:
        raise TrainError("; ".join(problems))


def _check_same_arguments(**arguments) -> None:
    """Every rank must be started with the same options (the config's contents are checked by the engine).

    Ranks that differ would not fail where they differ: another --seed trains on other data silently, another
    --out leaves a checkpoint without this rank's file, another --steps waits in a collective until the timeout.
    --config is not compared: each node may keep the file at its own path."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, arguments)
    for name in arguments:
        values = [theirs[name] for theirs in everyone]
        if len(set(map(repr, values))) > 1:
            flag = "--" + name.replace("_", "-")
            listing = ", ".join(f"rank {rank}: {v}" for rank, v in enumerate(values))
            raise TrainError(f"the ranks were started with different {flag} ({listing}); start every rank "
                             f"with the same command line, e.g. the same {flag} {values[0]}")  # fmt: skip


@contextmanager
def _sigterm_raises(distributed: bool):
    """Under torchrun, SIGTERM becomes an exception, so that a rank stopped by it says why before it goes."""
    if not distributed:
        yield
        return

    def stop(signum, frame):
        raise _Stopped("SIGTERM")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is stop:  # after a lost rank it stays ignored: see train()
            signal.signal(signal.SIGTERM, previous)


def _causes(err: BaseException | None):
    while err is not None:
        yield err
        err = err.__cause__


def _lost_a_rank(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is a collective that failed: a peer died or hung, or SIGTERM came."""
    return any(
        isinstance(e, (CommunicationError, dist.DistError, _Stopped))
        or any(backend in str(e) for backend in ("gloo", "NCCL"))  # a handle's wait() raises them bare
        for e in _causes(err)
    )


def _lost_message(err: BaseException, run: _Run | None, out: Path) -> str:
    rank, doing = dist.get_rank(), run.doing if run is not None else "start-up"
    if any(isinstance(e, _Stopped) for e in _causes(err)):
        what = (f"rank {rank} was stopped by SIGTERM during {doing}; torchrun sends it to the other ranks of a "
                "node when one fails, and its report names the rank that failed first.")  # fmt: skip
    else:
        detail = (str(err).strip() or type(err).__name__).splitlines()[0]
        what = (f"a rank was lost during {doing}: rank {rank} could not complete a collective with the others, "
                "so one of them died, was killed or hung (see --timeout), or its node or network failed.\n"
                f"  cause: {detail}")  # fmt: skip
    last = run_dir.newest_complete(out)
    if last is None:
        fix = ("No checkpoint had been saved (--save-every N saves one every N steps), so --resume has nothing "
               "to continue from: start the run again.")  # fmt: skip
    else:
        fix = (f"Restart the job, every node with the same command plus --resume: training continues from the "
               f"last checkpoint, {last}, and at the same world size logs the losses an uninterrupted run "
               "would have.")  # fmt: skip
    return f"{what}\n{fix}"
