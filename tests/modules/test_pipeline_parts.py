"""The pipeline's parts work on their own, from what their constructors and calls hand them (no pipeline).

The fp32 partition clears itself only from the state it is asked about, on the host queue; DPU's kept areas take
turns and read zeros for a unit no gradient reached; the early uploads wait for the update before going up.
"""

from __future__ import annotations

import torch

from tests.support.interleave import held_until_quiet
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.practice.early_uploads import EarlyUploads
from zero_offload.practice.host_gradients import GradientPartition, KeptGradients, PartitionState
from zero_offload.practice.pipeline import HostQueue


def test_the_partition_is_cleared_only_from_the_state_asked_about():
    host = HostQueue("host")
    flat = torch.full((6,), 7.0)
    partition = GradientPartition(flat, list(flat.split([2, 4])), host)
    assert partition.state is PartitionState.UNDEFINED
    # Nothing was added: nothing to clear.
    assert partition.clear_if(PartitionState.DIRTY) is None
    partition.clear_if(PartitionState.UNDEFINED).wait()
    assert partition.state is PartitionState.ZERO and not flat.any()
    norms = {}
    partition.add(1, torch.full((4,), 2.0), 0.5, norms).wait()
    assert partition.state is PartitionState.DIRTY
    assert flat.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0] and norms == {1: 4.0}
    assert partition.clear_if(PartitionState.UNDEFINED) is None
    partition.clear_if(PartitionState.DIRTY).wait()
    assert not flat.any()
    host.close()


def test_the_kept_areas_take_turns_and_an_unreached_unit_reads_zeros():
    accel = EmulatedAccelerator()
    down, host = accel.new_stream("down"), HostQueue("host")

    def to_host(dst, src, *, blocking=True):
        dst.copy_(src)

    kept = KeptGradients(accel, [2, 3], torch.float32, pin=False, to_host=to_host)
    norms = {}
    copied, done = kept.receive(0, torch.full((2,), 3.0), down=down, host=host, norms=norms)
    copied.wait(), done.wait()
    assert kept.landed == {0} and norms == {0: 18.0}
    # What the step two steps ago left in unit 1's region.
    kept.areas[0][1].fill_(5.0)
    assert [g.tolist() for g in kept.gradients()] == [[3.0, 3.0], [0.0, 0.0, 0.0]]
    kept.next_area(kept=True)
    assert kept.area == 1 and kept.landed == frozenset()
    # A step whose gradients were not kept leaves the area alone.
    kept.next_area(kept=False)
    assert kept.area == 1
    down.close(), host.close()


def test_early_uploads_wait_for_the_update_and_are_forgotten_once_taken():
    up, host = HostQueue("up"), HostQueue("host")
    sources, targets = [torch.zeros(2)], [torch.ones(2)]
    early = EarlyUploads(sources, targets, lambda dst, src, *, blocking: dst.copy_(src))
    # The update runs only once the up stream has run all it can: an upload that does not wait for it has
    # sent the old weights (zeros) by then.
    with held_until_quiet(host, up):
        early.start(host.submit(sources[0].fill_, 4.0))
        early.upload(0, up)
    assert early.take() == {0} and targets[0].tolist() == [4.0, 4.0]
    assert early.update is None and not early.queued
    up.close(), host.close()
