"""The torchrun jobs the project starts itself listen on loopback only: the rendezvous store (which has no
authentication) and gloo's sockets. Sockets are read from /proc; nothing here connects beyond 127.0.0.1."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zero_offload.cli.demo import run as demo
from zero_offload.cli.launch import loopback_endpoint, open_loopback_store, torchrun_command
from zero_offload.principles.process_group import free_port

REPO = Path(__file__).resolve().parents[2]
PROC_NET = Path("/proc/net/tcp")
needs_proc = pytest.mark.skipif(not PROC_NET.exists(), reason="reads listening sockets from /proc/net/tcp")


def _listening() -> dict[str, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket, IPv4 and IPv6."""
    found = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)  # the kernel writes each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found[fields[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    return found


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo += children.get(pid, [])
    return pids


def _sockets_of(pids: list[int]) -> set[tuple[str, int]]:
    """(address, port) of the listening sockets that processes `pids` hold open."""
    listening, held = _listening(), set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # the process ended meanwhile
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:  # closed meanwhile (the listing's own descriptor, for one)
                continue
            if link.startswith("socket:[") and link[8:-1] in listening:
                held.add(listening[link[8:-1]])
    return held


def _loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


@needs_proc
def test_the_store_opened_for_the_rendezvous_listens_on_loopback_only():
    port = free_port()
    store = open_loopback_store("127.0.0.1", port)
    try:
        assert _sockets_of([os.getpid()]) >= {("127.0.0.1", port)}
        assert all(_loopback(address) for address, p in _sockets_of([os.getpid()]) if p == port)
        store.set("key", "value")
    finally:
        del store


def test_only_a_static_rendezvous_on_loopback_is_bound_and_node_0_hosts_it():
    script = ["-m", "zero_offload.cli", "train"]
    assert loopback_endpoint(["--master_addr", "127.0.0.1", "--master_port", "29511", *script]) == (
        "127.0.0.1",
        29511,
        0,
    )
    node_1 = ["--nnodes", "2", "--node_rank", "1", "--master_addr", "localhost", "--master_port", "29511"]
    assert loopback_endpoint([*node_1, *script])[1:] == (29511, 1)
    assert loopback_endpoint(["--master_addr", "10.1.2.3", "--master_port", "29511", *script]) is None
    assert (
        loopback_endpoint(["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29511", *script]) is None
    )
    assert loopback_endpoint(["--standalone", *script]) is None


def test_nccl_is_kept_on_loopback_unless_told_otherwise(monkeypatch):
    import zero_offload.cli.launch as launch

    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "unset")  # recorded, so that the value main() sets is undone too
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    monkeypatch.setattr("torch.distributed.run.main", lambda argv: None)
    launch.main(
        ["--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port", "1", "x.py"]
    )
    assert os.environ["NCCL_SOCKET_IFNAME"].startswith("lo")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    launch.main(
        ["--nnodes", "2", "--node_rank", "1", "--master_addr", "127.0.0.1", "--master_port", "1", "x.py"]
    )
    assert os.environ["NCCL_SOCKET_IFNAME"] == "ib0"


def test_a_port_in_use_is_named_with_the_fix():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(SystemExit, match=r"127\.0\.0\.1:\d+.*--master_port"):
            open_loopback_store("127.0.0.1", busy.getsockname()[1])


def test_the_demo_launches_its_ranks_through_the_loopback_launcher(tmp_path, monkeypatch):
    seen = []

    def fake_run(command, **kwargs):
        seen.append(command)
        (tmp_path / "results.json").write_text("{}")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(demo.subprocess, "run", fake_run)
    demo._launch(tmp_path, ranks=2, budget=2**20, steps=1, quick=True)
    assert seen[0][1:3] == ["-m", "zero_offload.cli.launch"]
    assert seen[0][seen[0].index("--master_addr") + 1] == "127.0.0.1"


@pytest.mark.slow
@needs_proc
def test_a_two_node_job_listens_on_loopback_only(tmp_path):
    port = free_port()
    tool = [sys.executable, str(REPO / "tools" / "multinode.py"), "--nodes", "2", "--port", str(port), "--"]
    args = ["--model", "nano", "--steps", "6", "--out", str(tmp_path / "out")]
    job = subprocess.Popen([*tool, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    seen: set[tuple[str, int]] = set()
    deadline = time.monotonic() + 300
    while job.poll() is None and time.monotonic() < deadline:
        seen |= _sockets_of(_tree(job.pid))
        time.sleep(0.05)
    if job.poll() is None:
        job.terminate()
    output = job.communicate(timeout=60)[0]
    assert job.returncode == 0, output[-3000:]
    assert ("127.0.0.1", port) in seen, f"the rendezvous store was not seen listening: {seen}"
    assert len(seen) >= 3, f"expected the store and one gloo socket per rank: {seen}"
    assert all(_loopback(address) for address, _ in seen), f"listening beyond loopback: {sorted(seen)}"


def test_the_launch_command_is_torchruns_with_a_loopback_rendezvous():
    command = torchrun_command(["-m", "x"], port=1234, nproc=2, nodes=3, node=1)
    assert command[1:3] == ["-m", "zero_offload.cli.launch"]
    assert command[command.index("--master_addr") + 1 :][:3] == ["127.0.0.1", "--master_port", "1234"]
