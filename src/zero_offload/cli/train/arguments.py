"""The checks `zo train` makes on its options before it trains: each problem says what to change."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist


class TrainError(ValueError):
    """A command line that cannot run as given; the message says what to change."""


def check_arguments(config_path, steps, eval_every, eval_batches, save_every, keep, timeout) -> None:
    path = Path(config_path)
    if not path.is_file():
        why = "is a directory" if path.is_dir() else "does not exist"
        raise TrainError(
            f"config file {config_path} {why}; pass --config with the path of a DeepSpeed-style "
            "JSON file (`zo check-config FILE` checks one)"
        )
    least = {
        "--steps": (steps, 1),
        "--eval-every": (eval_every, 0),
        "--eval-batches": (eval_batches, 1),
        "--save-every": (save_every, 0),
        "--keep": (keep, 1),
    }
    problems = [
        f"{flag} must be at least {low}, got {value}" for flag, (value, low) in least.items() if value < low
    ]
    if timeout is not None and timeout <= 0:
        problems.append(f"--timeout is seconds, more than 0, got {timeout}")
    if problems:
        raise TrainError("; ".join(problems))


def check_same_arguments(**arguments) -> None:
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
            raise TrainError(
                f"the ranks were started with different {flag} ({listing}); start every rank "
                f"with the same command line, e.g. the same {flag} {values[0]}"
            )
