"""Run a function on N ranks of a real torch.distributed gloo group on loopback, and collect what each returns."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, fn, world_size, port, out_dir, args, timeout_s):
    torch.set_num_threads(1)  # N ranks share two cores
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except BaseException as err:  # e.g. the free port was taken by another process before rank 0 bound it
        torch.save(
            {"__rendezvous__": f"{type(err).__name__}: {err}"}, os.path.join(out_dir, f"rank{rank}.pt")
        )
        return
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException as err:  # reported to the parent, which re-raises it with the rank
        torch.save({"__error__": f"{type(err).__name__}: {err}"}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 60.0, attempts: int = 3) -> list:
    """fn(rank, world_size, *args) on each rank; returns what each returned, an {"__error__": ...} dict for a rank
    that raised, or {"__exitcode__": code} for one that died. Processes are joined, never left behind.

    free_port() closes the port it found before rank 0 binds it, so under a parallel test run another process can
    take it first (EADDRINUSE): then the whole group starts again on a new port, up to `attempts` times."""
    results = _run_once(fn, world_size, args, timeout_s)
    for _ in range(attempts - 1):
        if not any(_is_rendezvous(r) and "EADDRINUSE" in r["__rendezvous__"] for r in results):
            break
        results = _run_once(fn, world_size, args, timeout_s)
    return [{"__error__": r["__rendezvous__"]} if _is_rendezvous(r) else r for r in results]


def _is_rendezvous(result) -> bool:
    """A rank that could not join the group."""
    return isinstance(result, dict) and "__rendezvous__" in result


def _run_once(fn, world_size: int, args: tuple, timeout_s: float) -> list:
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [
            context.Process(target=_entry, args=(r, fn, world_size, port, out_dir, args, timeout_s))
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout_s * 3)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results = []
        for rank, proc in enumerate(procs):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if os.path.exists(path):
                results.append(torch.load(path, weights_only=False))
            else:
                results.append({"__exitcode__": proc.exitcode})
        return results


def check(results: list) -> list:
    """Re-raise the first rank's failure, with its rank."""
    for rank, result in enumerate(results):
        if isinstance(result, dict) and ("__error__" in result or "__exitcode__" in result):
            raise AssertionError(f"rank {rank}: {result.get('__error__') or result}")
    return results
