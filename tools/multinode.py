"""Run `zo train` or `zo demo` as several torchrun "nodes" on this machine, meeting on loopback
(`make train-multinode`, `make demo-multinode`).

    python tools/multinode.py --nodes 2 -- --model tiny --steps 50 --out out/train-multinode
    python tools/multinode.py --command demo --nodes 2 -- --out out/demo-multinode

Everything after `--` goes to the `zo` command; for `zo train` without a --config there, a small ZeRO-2 +
CPU-offload config is written to OUT/ds_config.json. Node i is one torchrun agent with --node_rank i, as it would
be on machine i:

    python -m zero_offload.cli.launch --nnodes N --node_rank i --nproc_per_node P --master_addr 127.0.0.1 \\
             --master_port PORT -m zero_offload.cli train ...    (or demo)

zero_offload.cli.launch is torchrun, except that node 0 opens the rendezvous store on 127.0.0.1 alone (torchrun's own
store listens on every interface). On real machines run torchrun on each, with --master_addr the first machine's
address and an --out they all share, behind the firewall README.md describes. When a node fails, the others get
--grace seconds to stop on their own (their ranks say which step was lost and how to resume) before they are
terminated.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from zero_offload.cli.launch import torchrun_command
from zero_offload.principles.process_group import free_port

CONFIG = {
    "train_batch_size": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True},
}


def node_command(
    node: int, nodes: int, nproc: int, port: int, args: list[str], command: str = "train"
) -> list[str]:
    """torchrun for node `node`, through zero_offload.cli.launch: its rendezvous store listens on 127.0.0.1 only."""
    return torchrun_command(
        ["-m", "zero_offload.cli", command, *args], port=port, nproc=nproc, nodes=nodes, node=node
    )


def wait_all(procs: list[subprocess.Popen], grace: float) -> int:
    """The first failing node's exit code (0 if none failed); the others are stopped `grace` s after it."""
    failed_at, code = None, 0
    while any(proc.poll() is None for proc in procs):
        failures = [proc.returncode for proc in procs if proc.returncode not in (None, 0)]
        if failures and failed_at is None:
            failed_at, code = time.monotonic(), failures[0]
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()  # torchrun passes it on to its ranks
            break
        time.sleep(0.2)
    for proc in procs:
        proc.wait()
    return code or next((proc.returncode for proc in procs if proc.returncode), 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--command", default="train", choices=["train", "demo"], help="the zo command to run")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--port", type=int, help="rendezvous port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--grace", type=float, default=60, help="seconds the others get after a node fails")
    args = parser.parse_args(ours)
    seen = argparse.ArgumentParser(add_help=False)
    seen.add_argument("--config")
    seen.add_argument("--out", default="out/train")
    known, _ = seen.parse_known_args(train_args)
    if args.command == "train" and known.config is None:
        config = Path(known.out) / "ds_config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(CONFIG, indent=2) + "\n", encoding="utf-8")
        train_args = ["--config", str(config), *train_args]
        print(f"using the example config {config}", file=sys.stderr)
    port = args.port or free_port()
    procs = [
        subprocess.Popen(node_command(node, args.nodes, args.nproc_per_node, port, train_args, args.command))
        for node in range(args.nodes)
    ]
    try:
        code = wait_all(procs, args.grace)
    except KeyboardInterrupt:
        for proc in procs:
            proc.terminate()
        code = 130
    print(f"{args.nodes} node(s) on loopback: exit code {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
