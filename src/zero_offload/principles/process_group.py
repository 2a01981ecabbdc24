"""Joining a torch.distributed process group: the one torchrun describes, with the backend the accelerator needs.

`zo.initialize` joins the group a launcher describes when the script has not (as `deepspeed.initialize` does);
`init_distributed` is the explicit call. gloo for the emulated device, kept on loopback when the ranks meet there;
NCCL for CUDA, one GPU per rank, chosen by LOCAL_RANK.
"""

from __future__ import annotations

import datetime
import inspect
import ipaddress
import os
import socket

import torch
import torch.distributed as dist

from ..accelerator import wants_cuda
from ..accelerator.cuda import gpu_of_this_rank
from .comm import Comm


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: for a rendezvous on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> Comm:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    The backend follows the accelerator: gloo for the emulated device, NCCL for CUDA. A rank that hangs makes
    the others fail after `timeout_s` (ZO_DIST_TIMEOUT, default 300 s) instead of waiting forever; one that dies
    makes them fail at once. The GPU is chosen by LOCAL_RANK (the rank on this node), which equals RANK only on
    the first node.
    """
    if not dist.is_initialized():
        timeout_s = timeout_s or float(os.environ.get("ZO_DIST_TIMEOUT", "300"))
        backend = backend or ("nccl" if wants_cuda() else "gloo")
        options = {}
        if backend == "gloo":
            _gloo_on_loopback()
        else:  # NCCL binds the group to this rank's GPU at once, where the installed torch can (2.3 and newer)
            gpu = gpu_of_this_rank()
            if "device_id" in inspect.signature(dist.init_process_group).parameters:
                options["device_id"] = torch.device("cuda", gpu)
        # torch.distributed.nn.functional puts the default group into its functions' default arguments when it
        # is imported, which building any torch.optim optimizer does (through torch._dynamo). Imported after
        # the group exists, it keeps the group alive past destroy_process_group(), and with it gloo's worker
        # threads to the end of the process; imported first, it binds None.
        from torch.distributed.nn import functional  # noqa: F401

        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **options)
    return Comm()


def join_launcher_group(backend: str | None = None) -> bool:
    """Join the group a launcher (torchrun) describes, if the script has not; True if this call created it.

    Like `deepspeed.initialize`, `zo.initialize` calls this first: a script started by `torchrun
    --nproc_per_node 2` that never calls init_process_group still trains as one job of two ranks, not as two
    jobs of one. A group that exists already must agree with the environment."""
    world = _env_int("WORLD_SIZE")
    if dist.is_available() and dist.is_initialized():
        rank = _env_int("RANK")
        if world is not None and world != dist.get_world_size():
            raise ValueError(
                f"the environment says WORLD_SIZE={world} but the process group that is already initialised "
                f"has {dist.get_world_size()} ranks; start the script with a launcher whose --nproc_per_node "
                "and --nnodes give the group's size, or initialise the group from the environment"
            )
        if rank is not None and rank != dist.get_rank():
            raise ValueError(
                f"the environment says RANK={rank} but this process is rank {dist.get_rank()} of the process "
                "group that is already initialised; initialise the group with the launcher's RANK"
            )
        return False
    if world is None or world <= 1:
        return False
    init_distributed(backend)
    return True


def leave_launcher_group() -> None:
    """Destroy the group join_launcher_group made, if it is still there (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


class JoinedGroup:
    """The group join_launcher_group made, shared by the engines that train on it: each engine holds it while
    it is open, and the last one to let go destroys it. A group the script made itself has no such owner."""

    def __init__(self):
        # Only a count: a reference to the group itself would keep gloo's threads alive after it is destroyed.
        self.holders = 0

    def hold(self) -> JoinedGroup:
        self.holders += 1
        return self

    def release(self) -> None:
        global _joined
        self.holders -= 1
        if self.holders == 0:
            _joined = None
            leave_launcher_group()


# The group join_launcher_group made, while an engine holds it.
_joined: JoinedGroup | None = None


def hold_launcher_group(backend: str | None = None) -> JoinedGroup | None:
    """Join the launcher's group as join_launcher_group does and hold it: the caller releases it when done.
    None when there is nothing to hold: one process, or a group the script made (the script destroys that)."""
    global _joined
    if join_launcher_group(backend):
        _joined = JoinedGroup()
    elif _joined is None or not dist.is_initialized():
        return None
    return _joined.hold()


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"the environment variable {name}={value!r} is not a whole number") from None


def _gloo_on_loopback() -> None:
    """Ranks that meet at a loopback MASTER_ADDR all run on this machine (one node, or several "nodes" on
    loopback): keep gloo's own connections on the loopback interface too, rather than on the interface the host
    name resolves to, which may be unreachable or exposed. GLOO_SOCKET_IFNAME, when set, wins."""
    address = os.environ.get("MASTER_ADDR")
    if not address or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
        names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]  # lo, lo0 (macOS)
    except (OSError, ValueError):
        return
    if loopback and names:
        os.environ["GLOO_SOCKET_IFNAME"] = names[0]
