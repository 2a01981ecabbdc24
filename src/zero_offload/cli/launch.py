"""torchrun, with its rendezvous store listening on the loopback address alone when the ranks meet on loopback.

torchrun's static rendezvous (--master_addr, --master_port) starts a c10d TCPStore in node 0's agent. The store
listens on every interface whatever --master_addr says, and it has no authentication: whoever reaches the port
can read and overwrite the keys the ranks meet by. torch 2.13 has no option to bind it to one address, but a
TCPStore can be handed a socket that already listens (`master_listen_fd`), and a multi-tenant store that a process
opens on a port reuses the server that process already runs there, as the rendezvous's store does. So when
MASTER_ADDR is a loopback address, node 0's agent first opens the store on a socket bound to that address, then
runs torchrun in the same process:

    python -m zero_offload.cli.launch --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29500 -m ...

On loopback NCCL_SOCKET_IFNAME also names the loopback interface, unless it is set. Any other rendezvous (a
non-loopback --master_addr, --rdzv-backend c10d, --standalone) is torchrun's own, unchanged.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import sys

from torch.distributed import TCPStore


def torchrun_command(args: list[str], *, port: int, nproc: int, nodes: int = 1, node: int = 0) -> list[str]:
    """The command that starts node `node` of `nodes` (`nproc` ranks each) meeting at 127.0.0.1:`port`, running
    `args` (for example `-m zero_offload.cli train ...`)."""
    return [sys.executable, "-m", "zero_offload.cli.launch", "--nnodes", str(nodes), "--node_rank", str(node),
            "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(port),
            *args]  # fmt: skip


def loopback_endpoint(argv: list[str]) -> tuple[str, int, int] | None:
    """(address, port, node rank) of a static rendezvous on loopback; None for any other rendezvous."""
    from torch.distributed.run import parse_args

    args = parse_args(argv)
    if args.standalone or args.rdzv_backend != "static":
        return None
    if args.rdzv_endpoint:
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, -1)
    elif args.master_port is None:
        return None  # torchrun then meets through a c10d rendezvous of its own on one node, or port 29500
    else:
        host, port = args.master_addr, args.master_port
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:  # a host name: bound only if it names this machine's loopback
        try:
            address = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
        except (OSError, ValueError):
            return None
    return (str(address), port, args.node_rank) if address.is_loopback and port > 0 else None


def open_loopback_store(address: str, port: int) -> TCPStore:
    """A TCPStore server listening on `address`:`port` only, for the rendezvous of this process to reuse.

    Keep the returned store referenced while torchrun runs: the rendezvous finds the server only while it lives."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise SystemExit(
            f"cannot open the rendezvous port {address}:{port}: {err}; another job uses it, so pass a free "
            "--master_port (or stop the job that holds it)"
        ) from err
    try:
        store = TCPStore(address, port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False,
                         multi_tenant=True, master_listen_fd=sock.fileno())  # fmt: skip
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now and closes it when it stops
    return store


def _nccl_on_loopback() -> None:
    """All ranks are on this machine: NCCL's bootstrap sockets stay on loopback too, not on the first interface
    it finds (gloo's do so through GLOO_SOCKET_IFNAME, which the ranks set). NCCL_SOCKET_IFNAME, when set, wins."""
    try:
        names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]  # lo, lo0 (macOS)
    except OSError:
        return
    if names and "NCCL_SOCKET_IFNAME" not in os.environ:
        os.environ["NCCL_SOCKET_IFNAME"] = names[0]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    from torch.distributed.run import main as torchrun

    endpoint = loopback_endpoint(argv)
    store = None
    if endpoint:
        address, port, node_rank = endpoint
        store = open_loopback_store(address, port) if node_rank == 0 else None
        _nccl_on_loopback()
    try:
        torchrun(argv)
    finally:
        del store


if __name__ == "__main__":
    main()
