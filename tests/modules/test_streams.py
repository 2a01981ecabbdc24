"""Streams, events, and the emulated device's asynchronous copies, with the hooks that force an interleaving."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.accelerator.streams import WorkerStream


def test_a_held_stream_starts_nothing_until_released():
    stream, ran = WorkerStream("held"), []
    hold = stream.hold()
    done = stream.submit(ran.append, 1)
    stream.wait_quiet(submitted=1)  # held: it can run nothing
    assert ran == [] and not done.done()
    hold.release()
    done.wait()
    assert ran == [1]
    hold.release()  # twice is harmless


def test_wait_quiet_returns_when_the_worker_waits_for_an_event_not_yet_done():
    blocker, stream, gate = WorkerStream("blocker"), WorkerStream("waiter"), threading.Event()
    pending = blocker.submit(gate.wait)
    stream.wait_event(pending)
    behind = stream.submit(lambda: None)
    stream.wait_quiet(submitted=1)  # stuck on `pending`: quiet
    assert not behind.done()
    gate.set()
    behind.wait()


def test_wait_quiet_times_out_on_a_worker_that_keeps_running():
    stream, gate = WorkerStream("busy"), threading.Event()
    stream.submit(gate.wait)  # running (not waiting for a stream event): never quiet
    try:
        with pytest.raises(TimeoutError, match="did not go quiet"):
            stream.wait_quiet(timeout=0.2)
    finally:
        gate.set()


def test_wait_quiet_waits_for_the_submissions_it_was_told_to_expect():
    stream = WorkerStream("late")
    with pytest.raises(TimeoutError, match="0 submitted"):
        stream.wait_quiet(submitted=1, timeout=0.2)


def _upload_case(pin: bool):
    accel = EmulatedAccelerator()
    host = accel.host_empty(8, torch.float32, pin=pin).fill_(1.0)
    device = accel.zeros(8, torch.float32, category="parameters")
    return accel, host, device


def test_a_non_blocking_upload_from_pinned_memory_reads_its_source_again_on_the_link():
    accel, host, device = _upload_case(pin=True)
    with accel.dma.hold() as hold:
        accel.copy_(device, host, non_blocking=True)
        assert torch.equal(device, torch.ones(8)), "later device work must see the copy at once"
        landed = accel.record_event()
        host.fill_(2.0)  # rewritten before the link has read it: a race on a GPU
        hold.release()
        landed.wait()
    assert torch.equal(device, torch.full((8,), 2.0)), "the link read the rewritten source, as DMA would"


def test_a_correct_program_sees_the_same_bytes_from_an_asynchronous_upload():
    accel, host, device = _upload_case(pin=True)
    accel.copy_(device, host, non_blocking=True)
    accel.record_event().wait()  # the host waits for the copy before it rewrites the source
    host.fill_(2.0)
    accel.fence_copies()
    assert torch.equal(device, torch.ones(8))


@pytest.mark.parametrize("case", ["pageable", "blocking", "on a stream"])
def test_uploads_that_are_done_when_they_return_are_done_once(case):
    accel, host, device = _upload_case(pin=case != "pageable")
    with accel.dma.hold():
        if case == "on a stream":  # already ordered on that stream: its event covers the copy
            WorkerStream("upload").submit(accel.copy_, device, host, non_blocking=True).wait()
        else:
            accel.copy_(device, host, non_blocking=case == "pageable")
        host.fill_(2.0)
    accel.fence_copies()
    assert torch.equal(device, torch.ones(8))


def test_fence_copies_waits_for_the_link():
    accel, host, device = _upload_case(pin=True)
    hold = accel.dma.hold()
    accel.copy_(device, host, non_blocking=True)
    host.fill_(3.0)
    fenced = threading.Event()
    fencer = threading.Thread(target=lambda: (accel.fence_copies(), fenced.set()))
    fencer.start()
    accel.dma.wait_quiet(submitted=2)  # the re-read and the fence's own marker, both held
    assert not fenced.is_set(), "fence_copies returned while a copy was still queued"
    hold.release()
    fencer.join()
    assert torch.equal(device, torch.full((8,), 3.0))


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priorities on this system")
def test_a_pinned_host_queue_yields_to_the_copy_streams_on_its_cores():
    """The copies stand in for DMA engines: on the host's cores they must not wait behind its Adam."""
    from zero_offload.practice.pipeline import HostQueue

    cores = sorted(os.sched_getaffinity(0))[:1]
    own = os.getpriority(os.PRIO_PROCESS, 0)
    pinned, unpinned, copy = HostQueue("pinned", cores), HostQueue("unpinned"), WorkerStream("copy", cores)

    def seen_from(stream):
        seen = []
        stream.submit(
            lambda: seen.append((os.getpriority(os.PRIO_PROCESS, 0), os.sched_getaffinity(0)))
        ).wait()
        return seen[0]

    try:
        assert seen_from(pinned) == (min(own + 10, 19), set(cores))
        assert seen_from(unpinned)[0] == own
        assert seen_from(copy) == (own, set(cores))
    finally:
        for stream in (pinned, unpinned, copy):
            stream.close()
