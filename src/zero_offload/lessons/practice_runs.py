"""Lesson 5, sections 6 and 7: the largest model a device holds, and `zo train` on one process and two "nodes".

The multi-process helpers start only their own children (torchrun agents in their own sessions) and kill only
those, so that a failed cell cannot leave ranks behind or touch anything else on the machine.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # the notebook displays the saved file
import matplotlib.pyplot as plt  # noqa: E402

from ..basics import estimate_model_states  # noqa: E402
from ..cli import main as zo_cli  # noqa: E402
from ..cli.train.run_dir import newest_complete  # noqa: E402
from ..principles.process_group import free_port  # noqa: E402
from ..tuning import perfmodel  # noqa: E402
from ..units import format_bytes, format_gb  # noqa: E402


def largest_fitting(hw, stage: int, offload: str, low: int = 10**8, high: int = 10**12) -> int:
    """Bisect the parameter count (to 10M) for the largest model perfmodel.plan says fits, batch 1, recompute."""
    while high - low > 10**7:  # low fits, high does not
        mid = (low + high) // 2
        fits = perfmodel.plan(hw, perfmodel.Workload(mid, batch=1, recompute=True), stage, offload).fits
        low, high = (mid, high) if fits else (low, mid)
    return low


def format_largest(budget: int, layers: int, alone: dict, alone_s: float, model: str, offloaded: dict) -> str:
    """The widest model that trains without offload (and why the next width does not), then the offloaded run."""
    return "\n".join(
        [
            f"device budget {format_bytes(budget)}; without offload (stage 0, bf16, {layers} layers, batch 1 x 32):",
            f"  largest that trains: d_model {alone['d_model']}, {alone['params']:,} parameters, device peak "
            f"{format_bytes(alone['device_peak'])} (bisection took {alone_s:.0f} s)",
            "  the next width (+64):\n"
            + textwrap.fill(alone["next_oom"], 116, initial_indent="    ", subsequent_indent="    "),
            f"\nwith stage 3 + offload_param + offload_optimizer: TinyGPT('{model}'), {offloaded['params']:,} parameters",
            f"  3 steps in {offloaded['seconds']:.1f} s, losses {', '.join(f'{v:.3f}' for v in offloaded['losses'])}; "
            f"device peak {format_bytes(offloaded['device_peak'])} of {format_bytes(budget)}; host "
            f"{format_bytes(offloaded['host_bytes'])} ({offloaded['host_bytes'] / offloaded['params']:.1f} bytes a parameter)",
            f"  {offloaded['params'] / alone['params']:.1f}x the parameters of the largest model without offload",
        ]
    )


def host_estimates(p1b: int, alone_params: int, total: int, available: int) -> tuple[str, float]:
    """The estimator's model states for '1b' and 13B, with and without offload; what '1b' needs of this host, and
    the largest model 90% of the host (`total` bytes) would hold at that rate. (text, that largest model)."""
    lines = [f"{'model':<24}{'configuration':<34}{'device':>11}{'host':>11}  (model states, one rank)"]
    both = dict(stage=3, offload_optimizer="cpu", offload_param="cpu")
    for label, params in ((f"'1b' ({p1b / 1e9:.2f}B)", p1b), ("13B", 13_000_000_000)):
        for conf, kwargs in (("stage 0, bf16", dict(stage=0)), ("stage 3 + both offloads, bf16", both)):
            est = estimate_model_states(params, world_size=1, precision="bf16", **kwargs)
            lines.append(f"{label:<24}{conf:<34}{format_gb(est.device):>11}{format_gb(est.host):>11}")
    one_b = estimate_model_states(p1b, world_size=1, precision="bf16", **both)
    need_1b = (
        one_b.host + 2 * p1b
    )  # + the bf16 model the engine copies its weights from, as offloaded_run checks
    host_limit = 0.9 * total / (need_1b / p1b)  # 10% left for the system, as zo plan leaves it
    lines.append(
        f"\ntraining '1b' with offload needs about {format_gb(need_1b)} of host memory "
        f"({need_1b / p1b:.0f} bytes a parameter); this machine has {format_gb(total)} "
        f"({format_gb(available)} available at this moment)"
    )
    lines.append(
        f"largest model 90% of this host could hold at that rate: about {host_limit / 1e9:.2f}B parameters, "
        f"{host_limit / alone_params:.0f}x the largest without offload"
    )
    return "\n".join(lines), host_limit


def plot_largest(bars: dict, budget_label: str, v100_bars: dict) -> plt.Figure:
    """Left: measured and estimated sizes on the emulated device; right: the model's V100 sizes and the paper's."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.bar(range(len(bars)), list(bars.values()), color=["tab:red", "tab:blue", "tab:blue", "lightgray"])
    for i, v in enumerate(bars.values()):
        ax1.text(i, v, f"{v / 1e6:,.0f}M", ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(bars)), list(bars), fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylabel("parameters")
    ax1.set_title(f"Emulated device, {budget_label} budget")
    ax2.bar(
        range(2),
        [v / 1e9 for v in v100_bars.values()],
        color=["tab:red", "tab:blue"],
        label="performance model",
    )
    ax2.scatter(range(2), [1.4, 13], color="black", marker="D", zorder=3, label="ZeRO-Offload paper")
    ax2.set_xticks(range(2), list(v100_bars))
    ax2.set_ylabel("billions of parameters")
    ax2.set_title("One V100-32GB, batch 1 x 1024, recompute")
    ax2.legend(fontsize=8)
    return fig


def zo_train(*args: str, root: Path) -> int:
    """`zo train ARGS` in this process, its progress bars and report kept out of the notebook; the exit code.

    Only the lines that say where training resumed and how each step went are printed (paths under `root`
    shortened), and the end of the output if it failed."""
    with contextlib.redirect_stdout(io.StringIO()) as said, contextlib.redirect_stderr(io.StringIO()):
        code = zo_cli(["train", *args])
    if code != 0:
        print(said.getvalue()[-3000:])
    for line in said.getvalue().splitlines():
        if line.startswith(("resumed from", "step ")):
            print(line.replace(str(root) + "/", ""))
    return code


def multinode(out: Path, config: Path, *train_args: str, root: Path, timeout: int = 600):
    """tools/multinode.py: two torchrun agents on this machine, one rank each, meeting on 127.0.0.1."""
    command = [
        sys.executable,
        str(root / "tools" / "multinode.py"),
        "--nodes",
        "2",
        "--grace",
        "20",
        "--",
        "--config",
        str(config),
        "--model",
        "tiny",
        "--out",
        str(out),
        *train_args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=timeout, env=env)


def kill_one_rank(out: Path, log_dir: Path, config: Path):
    """Start two nodes; once a checkpoint exists, SIGKILL node 1's rank (not its agent).

    Returns node 0's log, how long node 0 took to stop after the kill, and both agents' exit codes."""
    port = str(free_port())  # for the rendezvous, on loopback only
    args = [
        "--config",
        str(config),
        "--model",
        "tiny",
        "--steps",
        "100000",
        "--save-every",
        "4",
        "--timeout",
        "60",
        "--out",
        str(out),
    ]
    logs = [log_dir / f"node{node}.log" for node in (0, 1)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                "-m",
                "zero_offload.cli",
                "train",
                *args,
            ],
            stdout=logs[node].open("w"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    try:
        deadline = time.monotonic() + 300
        while newest_complete(out) is None:
            if time.monotonic() > deadline or any(n.poll() is not None for n in nodes):
                raise RuntimeError("no checkpoint appeared:\n" + logs[0].read_text()[-3000:])
            time.sleep(0.1)
        agent = nodes[1].pid
        (rank1,) = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()  # the agent's only child
        os.kill(int(rank1), signal.SIGKILL)
        killed = time.monotonic()
        nodes[0].wait(timeout=120)
        stopped_after = time.monotonic() - killed
        nodes[1].wait(timeout=120)
    finally:
        for node in nodes:  # only the agents started here, each with its own session
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    return logs[0].read_text(), stopped_after, [n.returncode for n in nodes]


def format_two_nodes(two: dict, one: dict, wall_s: float) -> str:
    """The two-node run's summary.json against the one-process run's: speed, losses, traffic."""
    rel = max(abs(a - b) / abs(b) for a, b in zip(two["losses"], one["losses"], strict=True))
    return "\n".join(
        [
            f"\ntwo nodes: world size {two['world_size']}, nodes {two['nodes']}, {two['steps']} steps in {wall_s:.0f} s "
            f"wall (start-up included), {two['ms_per_step']:.0f} ms a step; one process: {one['ms_per_step']:.0f} ms a step",
            f"loss {two['losses'][0]:.4f} -> {two['losses'][-1]:.4f}; largest relative difference from one process: "
            f"{rel:.1e}",
            f"eval losses, two nodes: {[round(e['loss'], 4) for e in two['eval_losses']]}; one process: "
            f"{[round(e['loss'], 4) for e in one['eval_losses']]}",
            f"reduce-scatter moved {two['traffic_elements'].get('reduce_scatter', 0):,} elements a rank; "
            f"PCIe (this rank): {two['pcie_bytes']}",
        ]
    )
