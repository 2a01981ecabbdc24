"""The timeline (practice/timeline.py): every stage of a step is recorded where and when it ran, per rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import zero_offload as zo
from tests.support.distributed import check, run_ranks
from tests.support.training import BATCH, SEQ, make_config
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.implementation.offload import Transfers
from zero_offload.practice.timeline import Timeline
from zero_offload.principles.comm import Comm
from zero_offload.workloads import TinyGPT, lm_loss


def _engine(stage=2, precision="fp16", **zero):
    return zo.initialize(
        TinyGPT("nano"), make_config(stage, precision, **zero), accelerator=EmulatedAccelerator()
    )


def _steps(engine, steps, rank=0, world_size=1):
    for step in range(steps):
        x = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        x = x[rank * BATCH // world_size : (rank + 1) * BATCH // world_size]
        engine.backward(lm_loss(engine(x), x))
        engine.step()


def _window(spans, stage):
    mine = [s for s in spans if s.stage == stage]
    assert mine, f"no {stage} span"
    return min(s.start for s in mine), max(s.end for s in mine)


def test_an_offloaded_step_records_every_stage_in_order(tmp_path):
    engine = _engine(offload_optimizer={"device": "cpu"}, reduce_bucket_size=20_000)
    _steps(engine, 2)
    [spans] = engine.timeline(tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert all(s.end >= s.start for s in spans)
    last = [s for s in spans if s.step == 1]
    # One rank: the weight shard is the whole buffer, so there is nothing to all-gather.
    # One rank: nothing to reduce, each bucket is already this rank's shard.
    assert {s.stage for s in last} == {"forward", "backward", "D2H", "Adam", "H2D"}
    forward, backward, adam = (_window(last, stage) for stage in ("forward", "backward", "Adam"))
    assert forward[1] <= backward[0] and backward[1] <= adam[0]
    # Gradients leave during backward, bucket by bucket; weights go up after Adam has started.
    d2h, h2d = _window(last, "D2H"), _window(last, "H2D")
    assert backward[0] <= d2h[0] and d2h[1] <= backward[1]
    assert h2d[0] >= adam[0]
    assert sum(s.stage == "D2H" for s in last) == len(engine.states.units)  # one copy a unit's shard


def test_only_the_last_steps_are_kept():
    timeline = Timeline(keep_steps=3)
    for step in range(10):
        timeline.begin_step(step)
        with timeline.span("forward"):
            pass
    assert [s.step for s in timeline.spans] == [7, 8, 9]
    with pytest.raises(ValueError, match="unknown stage 'fwd'"):
        timeline.add("fwd", 0.0, 1.0)


def _two_rank_timeline(rank, world_size, path):
    engine = _engine(3, "fp32", overlap_comm=True)  # stage 3: gathers, prefetched asynchronously
    _steps(engine, 2, rank, world_size)
    return engine.timeline(path if rank == 0 else None)


@pytest.mark.slow
def test_every_rank_sees_every_ranks_spans(tmp_path):
    results = check(run_ranks(_two_rank_timeline, 2, str(tmp_path / "two.png")))
    for by_rank in results:
        assert len(by_rank) == 2
        for spans in by_rank:
            stages = {s.stage for s in spans}
            assert {"forward", "backward", "reduce", "Adam", "all-gather"} <= stages
            assert all(s.end >= s.start for s in spans)
    assert (tmp_path / "two.png").exists()


# -- on CUDA: device work is timed by events -----------------------------------------------------------------
# No GPU is needed: torch.cuda.Event and current_stream are replaced by fakes that follow a scripted device clock.
# Each fake stream hands out the device times (ms) its events complete at, in recording order; the fake host
# clock is set by hand, so the two clocks disagree on purpose and a span shows which one it was read from.


class _FakeStream:
    def __init__(self, name, times_ms):
        self.name, self.times_ms = name, iter(times_ms)


class _FakeDevice:
    def __init__(self):
        self.default = _FakeStream("default", [0.0])
        self.current = self.default
        self.events, self.synchronized = [], []

    def event_class(self):
        device = self

        class FakeEvent:
            def __init__(self, enable_timing=False, **_):
                assert enable_timing, "an event without timing cannot be measured"
                self.stream = self.at = None
                device.events.append(self)

            def record(self, stream=None):
                self.stream = stream or device.current
                self.at = next(self.stream.times_ms)

            def synchronize(self):
                assert self.at is not None, "synchronized before it was recorded"
                device.synchronized.append(self)

            def elapsed_time(self, end):
                if self not in device.synchronized or end not in device.synchronized:
                    raise RuntimeError("elapsed_time of an event that has not completed")
                return end.at - self.at

        return FakeEvent


class _HostClock:
    """Returns the scripted `readings` first, then `now`."""

    def __init__(self, now):
        self.now, self.readings = now, []

    def perf_counter(self):
        return self.readings.pop(0) if self.readings else self.now


@pytest.fixture
def fake_cuda(monkeypatch):
    import zero_offload.practice.timeline as timeline_module

    device, clock = _FakeDevice(), _HostClock(100.0)
    monkeypatch.setattr(torch.cuda, "Event", device.event_class())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device_=None: device.current)

    def no_device_sync(*_):
        raise AssertionError("the whole device was synchronized")

    monkeypatch.setattr(torch.cuda, "synchronize", no_device_sync)
    monkeypatch.setattr(timeline_module, "time", clock)
    return device, clock


def _cuda_timeline(device, clock, **kwargs):
    """A timeline told it runs on CUDA; made at host time 100 s, its reference read at 100.25 s."""
    accel = SimpleNamespace(name="cuda", device=torch.device("cuda", 0))
    clock.readings = [100.0, 100.25]  # the origin, then the reference's host time
    timeline = Timeline(accelerator=accel, **kwargs)
    assert not clock.readings
    return timeline


def _approx(span, stage, start, end):
    assert span.stage == stage
    assert (span.start, span.end) == (pytest.approx(start), pytest.approx(end))


def test_device_spans_come_from_events_and_host_spans_from_the_host_clock(fake_cuda):
    device, clock = fake_cuda
    timeline = _cuda_timeline(device, clock)
    [reference] = device.events
    assert device.synchronized == [reference]  # once, before its host time was read
    device.default.times_ms = iter([300.0, 500.0])
    clock.now = 101.0
    with timeline.span("forward"):
        clock.now = 109.0  # the host says 8 s; the device says 0.2 s
    with timeline.span("Adam"):
        clock.now = 112.0
    timeline.add("NVMe write", 112.0, 113.5)
    assert len(device.events) == 3  # two for forward, none for host work
    assert device.synchronized == [reference]  # recording waits for nothing
    forward, adam, nvme = timeline.spans
    # Placed by the reference: 100.25 s on the host is 0 ms on the device; the timeline began at 100 s.
    _approx(forward, "forward", 0.25 + 0.3, 0.25 + 0.5)
    _approx(adam, "Adam", 9.0, 12.0)
    _approx(nvme, "NVMe write", 12.0, 13.5)
    assert device.synchronized == device.events  # the reference and forward's two events, nothing else


def test_copies_are_timed_on_the_stream_they_run_on(fake_cuda):
    device, clock = fake_cuda
    timeline = _cuda_timeline(device, clock)
    accel = EmulatedAccelerator()
    transfers = Transfers(accel, timeline=timeline)
    side = _FakeStream("side", [20.0, 70.0])
    device.current = side  # as inside `torch.cuda.stream(side)`, where module 5's copies run
    on_device = accel.zeros(8, torch.float16)
    transfers.to_host(torch.empty(8, dtype=torch.float16), on_device)
    device.current = device.default
    device.default.times_ms = iter([80.0, 95.0])
    transfers.to_device(on_device, torch.ones(8, dtype=torch.float16))
    assert [e.stream.name for e in device.events[1:]] == ["side", "side", "default", "default"]
    down, up = timeline.spans
    _approx(down, "D2H", 0.25 + 0.020, 0.25 + 0.070)
    _approx(up, "H2D", 0.25 + 0.080, 0.25 + 0.095)
    assert transfers.bytes == {"d2h": 16, "h2d": 16}


class _Handle:
    def is_completed(self):
        return True

    def wait(self):
        return "done"


def test_a_collective_ends_when_it_is_waited_for(fake_cuda):
    device, clock = fake_cuda
    timeline = _cuda_timeline(device, clock)
    device.default.times_ms = iter([10.0, 20.0, 30.0, 90.0, 95.0, 96.0])
    handle = timeline.until_done("reduce", timeline.mark("reduce"), _Handle())
    with timeline.span("backward"):  # backward goes on while the reduce-scatter runs
        pass
    assert handle.wait() == "done"
    comm = Comm(timeline=timeline)  # one process: the collective is a local copy, still device work
    comm.reduce_scatter(torch.empty(4), torch.ones(4))
    backward, reduce, local = timeline.spans
    _approx(backward, "backward", 0.25 + 0.020, 0.25 + 0.030)
    _approx(reduce, "reduce", 0.25 + 0.010, 0.25 + 0.090)
    _approx(local, "reduce", 0.25 + 0.095, 0.25 + 0.096)


def test_reading_waits_only_for_the_kept_spans_and_only_once(fake_cuda):
    device, clock = fake_cuda
    timeline = _cuda_timeline(device, clock, keep_steps=2)
    device.default.times_ms = iter(range(0, 80, 10))
    for step in range(4):
        timeline.begin_step(step)
        with timeline.span("backward"):
            pass
    reference = device.events[0]
    kept = device.events[-4:]  # steps 2 and 3
    assert [s.step for s in timeline.spans] == [2, 3]
    assert device.synchronized == [reference, *kept]
    assert [(s.start, s.end) for s in timeline.spans] == [
        (pytest.approx(0.25 + 0.040), pytest.approx(0.25 + 0.050)),
        (pytest.approx(0.25 + 0.060), pytest.approx(0.25 + 0.070)),
    ]
    assert len(device.synchronized) == 5  # the second read found them resolved


def test_without_cuda_no_event_is_made(monkeypatch):
    def no_events(*_, **__):
        raise AssertionError("a CUDA event was made")

    monkeypatch.setattr(torch.cuda, "Event", no_events)
    for timeline in (Timeline(), Timeline(accelerator=EmulatedAccelerator())):
        with timeline.span("forward"):
            pass
        [span] = timeline.spans
        assert span.stage == "forward" and 0.0 <= span.start <= span.end
