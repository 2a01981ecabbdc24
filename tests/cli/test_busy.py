"""The busy times and the bound that `make bench` reports next to each schedule (cli/bench/busy.py)."""

from __future__ import annotations

import threading
import time

import pytest

from zero_offload.accelerator.streams import WorkerStream, seconds_blocked
from zero_offload.cli.bench.busy import Busy, cpu_seconds
from zero_offload.cli.bench.schedules import compare_schedules
from zero_offload.cli.bench.training import print_schedules


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_work_on_another_thread_is_the_hosts_and_waiting_is_nobodys():
    start = cpu_seconds()
    worker = threading.Thread(target=_burn, args=(0.2,))
    worker.start()
    worker.join()  # this thread waits: no CPU time of its own
    time.sleep(0.05)
    busy = Busy.since(start)
    assert busy.host >= 0.19 and busy.device < 0.05
    start = cpu_seconds()
    _burn(0.1)
    busy = Busy.since(start)
    assert busy.device >= 0.099 and busy.host < 0.05


def test_blocking_on_an_event_is_counted_as_waited_and_an_event_already_done_costs_nothing():
    stream = WorkerStream("held")
    hold = stream.hold()
    done = stream.submit(lambda: None)
    start = cpu_seconds()
    threading.Timer(0.1, hold.release).start()
    done.wait()  # blocked until the timer releases the stream, at least 0.1 s after it was started
    busy = Busy.since(start)
    assert busy.waited >= 0.05 and busy.device < 0.05
    before = seconds_blocked()
    done.wait()
    assert seconds_blocked() == before
    failed = stream.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # an error on the stream still surfaces through a counted wait
        failed.wait()
    stream.close()


def test_the_bound_is_the_busier_side_or_the_shared_cores_work():
    busy = Busy(device=0.030, host=0.050)
    assert busy.bound(1, 1) == pytest.approx(0.050)  # split: the host is the bottleneck
    assert busy.bound(1, 2) == pytest.approx(0.030)  # two host cores: the device is
    assert busy.bound(2, None) == pytest.approx(0.040)  # shared: all the work over both cores
    assert Busy(0.050, 0.010).bound(2, None) == pytest.approx(0.050)  # but never below the device's own work
    assert (Busy(1.0, 2.0) + Busy(0.5, 0.25)) == Busy(1.5, 2.25)
    assert (Busy(1.0, 2.0, 0.5) + Busy(0.5, 0.25, 0.25)).waited == 0.75


def test_compare_schedules_reports_busy_times_and_the_bound(tmp_path, capsys):
    r = compare_schedules("nano", seq_len=8, steps=2, rounds=1, cores="shared", out_dir=tmp_path)
    for name, wall in r["median_ms"].items():
        busy, bound = r["busy_ms"][name], r["bound_ms"][name]
        assert busy["device"] > 0 and busy["host"] >= 0 and busy["waited"] >= 0
        assert bound >= busy["device"]  # shared cores: never below the device's own work
        assert r["of_bound"][name] == pytest.approx(wall / bound)
        assert r["mean_ms"][name] > 0 and r["landing_ms"][name] >= 0
    assert (tmp_path / "step_shared.png").stat().st_size > 10_000
    print_schedules("nano, shared", r)  # what make bench prints from it
    printed = capsys.readouterr().out
    assert printed.count("device waited") == 3 and "DPU/overlapped" in printed
    trace = tmp_path / "timeline_delayed_shared.json"
    assert trace.stat().st_size > 0
