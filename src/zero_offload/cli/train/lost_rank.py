"""When a rank of `zo train` dies or hangs: stop every other rank with an error that says how to resume.

A rank that dies takes the job down: the others cannot finish a collective without it. They stop at once (or,
for a rank that hangs, after --timeout seconds) with an error that names the step and the checkpoint that
`--resume` continues from.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from ...principles.comm import CommunicationError
from . import run_dir
from .training_run import TrainingRun


class RankLostError(RuntimeError):
    """Another rank died or stopped answering, so this one cannot go on; the message says how to resume."""


class StoppedBySigterm(Exception):  # not a RuntimeError: Comm would report it as a failed collective
    """SIGTERM: torchrun sends it to the other ranks of a node when one of them has failed."""


@contextmanager
def sigterm_raises(distributed: bool):
    """Under torchrun, SIGTERM becomes an exception, so that a rank stopped by it says why before it goes."""
    if not distributed:
        yield
        return

    def stop(signum, frame):
        raise StoppedBySigterm("SIGTERM")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        # After a lost rank, SIGTERM stays ignored (see trainer.train), so that the message gets out whole.
        if signal.getsignal(signal.SIGTERM) is stop:
            signal.signal(signal.SIGTERM, previous)


def _causes(err: BaseException | None):
    while err is not None:
        yield err
        err = err.__cause__


def lost_a_rank(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is a collective that failed: a peer died or hung, or SIGTERM came."""
    return any(
        isinstance(e, (CommunicationError, dist.DistError, StoppedBySigterm))
        or any(backend in str(e) for backend in ("gloo", "NCCL"))  # a handle's wait() raises them bare
        for e in _causes(err)
    )


def lost_message(err: BaseException, run: TrainingRun | None, out: Path) -> str:
    rank, doing = dist.get_rank(), run.doing if run is not None else "start-up"
    if any(isinstance(e, StoppedBySigterm) for e in _causes(err)):
        what = (
            f"rank {rank} was stopped by SIGTERM during {doing}; torchrun sends it to the other ranks of a "
            "node when one fails, and its report names the rank that failed first."
        )
    else:
        detail = (str(err).strip() or type(err).__name__).splitlines()[0]
        what = (
            f"a rank was lost during {doing}: rank {rank} could not complete a collective with the others, "
            "so one of them died, was killed or hung (see --timeout), or its node or network failed.\n"
            f"  cause: {detail}"
        )
    last = run_dir.newest_complete(out)
    if last is None:
        fix = (
            "No checkpoint had been saved (--save-every N saves one every N steps), so --resume has nothing "
            "to continue from: start the run again."
        )
    else:
        fix = (
            f"Restart the job, every node with the same command plus --resume: training continues from the "
            f"last checkpoint, {last}, and at the same world size logs the losses an uninterrupted run "
            "would have."
        )
    return f"{what}\n{fix}"
