"""`zo train` as users run it: resume, evaluation, the report, bad input, two loopback "nodes", a killed rank.

One-process runs call the command in this process (zero_offload.cli.main), which spares a start-up each; the
multi-process ones start torchrun agents as a user would, meeting on loopback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.distributed import free_port
from zero_offload import plots
from zero_offload.cli import main
from zero_offload.cli.train.run_dir import newest_complete
from zero_offload.implementation import checkpoint

REPO = Path(__file__).resolve().parents[2]
# fp32 with a modest lr: resumed runs must log the very same floats, and 2 ranks the 1-rank losses to 1e-5.
BASE = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
OFFLOAD = {
    **BASE,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True},
    "zero_offload": {"cpu_adam": {"impl": "torch"}},
}
CONFIGS = {"stage2-offload": OFFLOAD, "stage0": {**BASE, "zero_optimization": {"stage": 0}}}


def _config(tmp_path, config=OFFLOAD) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def _args(config, out, steps, *extra) -> list[str]:
    return ["--config", str(config), "--model", "nano", "--steps", str(steps), "--out", str(out), *extra]


def _train(config, out, steps, *extra) -> int:
    """`zo train ...` in this process; its exit code."""
    return main(["train", *_args(config, out, steps, *extra)])


def _summary(out) -> dict:
    return json.loads((Path(out) / "summary.json").read_text())


def _skip_saving_plots(monkeypatch) -> None:
    """Figures are made but not laid out or saved (most of a short run's time); the report test saves them."""
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: (plots.plt.close(fig), Path(path))[1])


@pytest.fixture
def no_plots(monkeypatch):
    _skip_saving_plots(monkeypatch)


@pytest.mark.parametrize("name", CONFIGS)
def test_resume_logs_the_losses_of_an_uninterrupted_run(tmp_path, name, no_plots):
    config, evals = _config(tmp_path, CONFIGS[name]), ("--eval-every", "3", "--eval-batches", "2")
    assert _train(config, tmp_path / "straight", 6, *evals) == 0
    assert _train(config, tmp_path / "split", 3, *evals, "--save-every", "3") == 0
    unfinished = tmp_path / "split" / "checkpoints" / "step_5"  # as a run killed while saving leaves it
    unfinished.mkdir()
    (unfinished / "rank00000-of-00001.pt").write_bytes(b"half")
    assert _train(config, tmp_path / "split", 6, *evals, "--save-every", "3", "--resume") == 0
    assert not unfinished.exists()
    straight, resumed = _summary(tmp_path / "straight"), _summary(tmp_path / "split")
    assert resumed["resumed_at"] == 3 and len(resumed["losses"]) == 6
    # Bit for bit: the data is a function of the step, and the checkpoint restores everything else.
    assert resumed["losses"] == straight["losses"]
    assert resumed["eval_losses"] == straight["eval_losses"]


def test_eval_progress_report_and_checkpoints(tmp_path, capsys):
    out = tmp_path / "out"
    assert (
        _train(_config(tmp_path), out, 6, "--eval-every", "2", "--eval-batches", "1", "--save-every", "2")
        == 0
    )
    printed = capsys.readouterr()
    assert re.findall(r"step (\d+): eval loss \d\.\d{4}", printed.out) == ["2", "4", "6"]
    assert "tokens/s=" in printed.err and "loss=" in printed.err  # the progress bar
    summary = _summary(out)
    assert (summary["world_size"], summary["nodes"], summary["steps"]) == (1, 1, 6)
    assert [e["step"] for e in summary["eval_losses"]] == [2, 4, 6]
    assert len(summary["tokens_per_s"]) == len(summary["step_ms"]) == 6 and min(summary["tokens_per_s"]) > 0
    assert summary["memory"]["estimated"] == summary["memory"]["measured"]
    assert summary["memory"]["measured"]["host"] > 0 and summary["pcie_bytes"]  # the optimizer is offloaded
    for plot in ("loss", "throughput", "memory", "timeline"):
        assert (out / f"{plot}.png").stat().st_size > 10_000, plot
        assert str(out / f"{plot}.png") in printed.out
    trace = json.loads((out / "trace.json").read_text())  # the timeline, for ui.perfetto.dev
    assert isinstance(trace["traceEvents"], list) and str(out / "trace.json") in printed.out
    assert summary["checkpoints"] == ["step_4", "step_6"]  # --keep 2: step_2 went once step_6 was complete
    history = json.loads((out / "checkpoints" / "step_6" / "history.json").read_text())
    assert history["losses"] == summary["losses"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished run of the nano model with a checkpoint at step 2."""
    tmp_path = tmp_path_factory.mktemp("saved")
    config = _config(tmp_path)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _skip_saving_plots(monkeypatch)
        assert _train(config, tmp_path / "out", 2, "--save-every", "2") == 0
    return config, tmp_path / "out"


BAD_INPUT = {
    "missing config": (lambda tmp: ["--config", str(tmp / "nope.json")], "nope.json does not exist"),
    "resume, nothing saved": (lambda tmp: ["--out", str(tmp / "empty"), "--resume"], "no complete checkpoint"),
    "another model's checkpoint": (lambda tmp: ["--model", "tiny", "--resume"], "resume with --model nano"),
    "fresh run over checkpoints": (lambda tmp: [], "pass --resume to continue it"),
    "nothing left to train": (lambda tmp: ["--steps", "2", "--resume"], "pass a --steps above 2"),
    "bad config": (
        lambda tmp: ["--config", str(_config(tmp, {**BASE, "zero_optimization": {
            "stage": 2, "offload_param": {"device": "cpu"}}}))],
        "parameter offload needs stage 3",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_named_with_its_fix_and_exit_code_2(saved_run, tmp_path, capsys, case, no_plots):
    config, out = saved_run
    make, expected = BAD_INPUT[case]
    # The later of a repeated option wins, as argparse reads them.
    assert main(["train", *_args(config, out, 4), *make(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err


def _torchrun_node(node: int, port: int, args: list[str], log: Path) -> subprocess.Popen:
    """One torchrun agent of a 2-node job on loopback, with one rank; its own session, so cleanup can end
    the agent and its rank together. Output goes to a file: a full pipe would stall the rank."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "zero_offload.cli", "train", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _end(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_two_nodes_on_loopback_match_one_process(tmp_path, no_plots):
    config, evals = _config(tmp_path), ("--eval-every", "2", "--eval-batches", "2")
    assert _train(config, tmp_path / "one", 4, *evals) == 0
    tool = [sys.executable, str(REPO / "tools" / "multinode.py"), "--nodes", "2", "--grace", "20", "--"]
    run = subprocess.run([*tool, *_args(config, tmp_path / "two", 4, *evals)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    one, two = _summary(tmp_path / "one"), _summary(tmp_path / "two")
    assert (two["world_size"], two["nodes"]) == (2, 2) and two["traffic_elements"]["reduce_scatter"] > 0
    # Each rank takes half of every global batch: the same training, up to the order of the sums.
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert [e["loss"] for e in two["eval_losses"]] == pytest.approx(
        [e["loss"] for e in one["eval_losses"]], rel=1e-5
    )


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the rank to kill through /proc")
def test_a_killed_rank_ends_the_job_with_an_error_that_says_how_to_resume(tmp_path, no_plots):
    # A rank that missed the loss would sit in its collective until --timeout: rank 0 must be gone well before.
    # The deadline is a hang guard, not a speed: seeing the lost rank takes seconds, the timeout minutes.
    timeout = 240
    config, out, port = _config(tmp_path), tmp_path / "out", free_port()
    args = _args(config, out, 100_000, "--save-every", "2", "--timeout", str(timeout))
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    nodes = [_torchrun_node(node, port, args, logs[node]) for node in (0, 1)]
    try:
        deadline = time.monotonic() + 240
        while newest_complete(out) is None:
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), logs[0].read_text()[
                -3000:
            ]
            time.sleep(0.05)
        agent = nodes[1].pid
        (rank1,) = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
        os.kill(int(rank1), signal.SIGKILL)
        try:
            nodes[0].wait(timeout=timeout / 2)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 still runs {timeout / 2:.0f} s after rank 1 was killed: it waits in a collective "
                        f"for the --timeout of {timeout} s instead of seeing that a rank was lost")  # fmt: skip
        nodes[1].wait(timeout=120)
    finally:
        _end(nodes)
    log = logs[0].read_text()
    assert nodes[0].returncode != 0 and nodes[1].returncode != 0
    # The kill lands in a step, or in the collective of a checkpoint or an evaluation: whichever rank 0 is in then.
    assert re.search(
        r"error: a rank was lost during (step \d+|the (checkpoint|evaluation) after step \d+): rank 0 could not complete a "
        "collective",
        log,
    ), log[-3000:]
    resume_from = Path(
        re.search(r"plus --resume: training continues from the last checkpoint, (\S+),", log)[1]
    )
    assert resume_from.parent == out / "checkpoints" and checkpoint.complete(resume_from)

    # --resume continues from there, here on one process: the losses of one uninterrupted process (to 1e-5, as
    # the world size changed), with the steps before the kill in the report.
    saved = int(resume_from.name.removeprefix("step_"))
    assert _train(config, out, saved + 2, "--resume") == 0
    assert _train(config, tmp_path / "straight", saved + 2) == 0
    resumed, straight = _summary(out), _summary(tmp_path / "straight")
    assert resumed["resumed_at"] == saved
    assert resumed["losses"] == pytest.approx(straight["losses"], rel=1e-5)


def _nan_loss_from(monkeypatch, steps) -> None:
    """The trainer's loss is nan at the given steps (1-based; one micro-batch a step, no evaluation)."""
    from zero_offload.cli.train import training_run

    calls = iter(range(1, 10_000))
    real = training_run.lm_loss
    monkeypatch.setattr(
        training_run, "lm_loss", lambda *a: real(*a) * (float("nan") if next(calls) in steps else 1)
    )


def test_a_nan_step_is_skipped_and_counted_in_the_summary(tmp_path, capsys, monkeypatch, no_plots):
    _nan_loss_from(monkeypatch, {3})
    out = tmp_path / "out"
    with pytest.warns(RuntimeWarning, match=r"step 3 skipped \(non-finite loss\)"):
        assert _train(_config(tmp_path, CONFIGS["stage0"]), out, 5) == 0
    assert _summary(out)["skipped_steps"] == 1
    assert "1 step(s) skipped (inf/nan)" in capsys.readouterr().out


def test_nan_steps_in_a_row_stop_zo_train_naming_the_step_and_the_checkpoint(
    tmp_path, capsys, monkeypatch, no_plots
):
    _nan_loss_from(monkeypatch, set(range(3, 100)))
    config = _config(
        tmp_path, {**OFFLOAD, "zero_offload": {"cpu_adam": {"impl": "torch"}, "max_skipped_steps": 2}}
    )
    out = tmp_path / "out"
    with pytest.warns(RuntimeWarning, match="1 in a row, training stops at 2"):
        assert _train(config, out, 8, "--save-every", "2") == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: training diverged: step 4 is the 2nd step in a row"
    )
    assert f"The last checkpoint is {out / 'checkpoints' / 'step_2'} (step 2)" in errors[0]
