"""The files of one `zo train` run under --out: the checkpoints it resumes from, and its report.

    <out>/checkpoints/step_<n>/   engine.save_checkpoint's directory (its save step<n> and `latest`), plus
                                  history.json: the losses, eval losses and step times of steps 1..n, so that a
                                  resumed run reports the whole run
    <out>/summary.json, loss.png, throughput.png, memory.png       rank 0, at the end (timeline.png: the engine)

A checkpoint is complete once its `latest` names a save. history.json goes in first and the engine writes
`latest` last of all, so a run killed while saving leaves the checkpoint before it as the newest complete one. Every rank
writes its own part of a checkpoint: on several machines --out must be a directory they share.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from ...basics.memory import TIERS
from ...implementation.checkpoint import CheckpointError, complete
from ...implementation.durable import write_error, write_temp

CHECKPOINTS, HISTORY = "checkpoints", "history.json"
_STEP_DIR = re.compile(r"step_(\d+)")


def checkpoints(out) -> list[tuple[int, Path]]:
    """(step, directory) of every step_<n> directory under <out>/checkpoints, complete or not, oldest first."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = ((_STEP_DIR.fullmatch(path.name), path) for path in root.iterdir() if path.is_dir())
    return sorted((int(match.group(1)), path) for match, path in found if match)


def _complete(path: Path) -> bool:
    return complete(path) and (path / HISTORY).is_file()


def newest_complete(out) -> Path | None:
    return next((path for _, path in reversed(checkpoints(out)) if _complete(path)), None)


def scan(out, comm) -> tuple[Path | None, int]:
    """The newest complete checkpoint under --out and the number of step directories, agreed by every rank."""
    newest = newest_complete(out)
    found = (None if newest is None else str(newest), len(checkpoints(out)))
    if comm.distributed:
        views = [None] * comm.world_size
        dist.all_gather_object(views, found, group=comm.group)
        if len(set(views)) > 1:
            seen = "; ".join(f"rank {rank} sees {view[0] or 'none'}" for rank, view in enumerate(views))
            raise CheckpointError(
                f"the ranks see different checkpoints under {Path(out) / CHECKPOINTS} ({seen}): every rank "
                "saves and loads its part there, so on several machines --out must be a shared directory"
            )
    return newest, found[1]


def save(engine, out, history: dict, keep: int) -> Path:
    """Checkpoint `engine` at its step under <out>/checkpoints with `history`; keep only the newest `keep`."""
    path = Path(out) / CHECKPOINTS / f"step_{engine.global_steps}"
    error = None
    if engine.comm.rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            text = json.dumps(history).encode()
            os.replace(write_temp(path / HISTORY, lambda file: file.write(text)), path / HISTORY)
        except OSError as err:
            error = write_error(path / HISTORY, err, "No checkpoint was saved.")
    elsewhere = CheckpointError(
        "rank 0 could not write the run's history; see its error. No checkpoint was saved."
    )
    engine.comm.raise_together(error, elsewhere)
    engine.save_checkpoint(path)  # returns on every rank once `latest` is in place
    if engine.comm.rank == 0:
        complete = [step for step, found in checkpoints(out) if _complete(found)]
        if len(complete) > keep:
            remove(out, lambda step: step < complete[-keep])
    return path


def remove(out, which) -> None:
    """Delete the step directories whose step makes which(step) true (rank 0: old ones, or a dead run's
    unfinished ones)."""
    for step, path in checkpoints(out):
        if which(step):
            shutil.rmtree(path, ignore_errors=True)


def load_history(path) -> dict:
    try:
        return json.loads((Path(path) / HISTORY).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"cannot read {Path(path) / HISTORY}: {err}; resume from another checkpoint"
        ) from err


def write_report(out, summary: dict, report, *, title: str) -> list[Path]:
    """summary.json and the plots of losses, throughput and model-state memory per tier (rank 0)."""
    from ...plots import LOSS_LABEL, plot_curves, plot_model_states  # matplotlib: only the rank that draws

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    steps = range(1, len(summary["losses"]) + 1)
    curves = {"train (one global batch)": (steps, summary["losses"])}
    if summary["eval_losses"]:
        evals = summary["eval_losses"]
        curves["eval (held-out text)"] = ([e["step"] for e in evals], [e["loss"] for e in evals])
    largest = max(report.estimated.total, report.measured.total)
    unit, unit_name = (1e9, "GB") if largest >= 1e9 else (1e6, "MB")
    return [
        out / "summary.json",
        plot_curves(curves, out / "loss.png", title=title, ylabel=LOSS_LABEL),
        plot_curves(
            {f"{summary['world_size']} rank(s)": (steps, summary["tokens_per_s"])},
            out / "throughput.png",
            title=f"Training throughput ({summary['tokens_per_step']:,} tokens a step)",
            ylabel="tokens per second, all ranks",
        ),
        plot_model_states(
            {"estimated": report.estimated, "measured": report.measured},
            out / "memory.png",
            title=f"Model states per tier, one rank of {summary['world_size']}",
            tiers=TIERS,
            unit=unit,
            unit_name=unit_name,
        ),
    ]
