"""The copies between device and host (implementation/transfers.py): the same dtype on both sides, one
direction each, nothing counted for a copy that was refused; host buffers page-locked where the machine allows
it, pageable memory with one warning where it does not, and training goes on either way."""

from __future__ import annotations

import pytest
import torch

import zero_offload as zo
from tests.modules.test_offload import _engine, _one_step
from tests.support.training import BATCH, SEQ, make_config
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.implementation.offload import Transfers
from zero_offload.workloads import TinyGPT, lm_loss


def test_transfers_refuse_casts_and_wrong_directions():
    accel = EmulatedAccelerator()
    transfers = Transfers(accel)
    device16 = accel.empty(8, torch.float16, category="buckets")
    with pytest.raises(ValueError, match="cast on one side first"):
        transfers.to_host(torch.empty(8, dtype=torch.float32), device16)
    with pytest.raises(ValueError, match="from host to host"):
        transfers.to_device(torch.empty(8, dtype=torch.float16), torch.empty(8, dtype=torch.float16))
    assert not transfers.bytes


def test_pinning_that_fails_falls_back_to_pageable_memory_with_one_warning(monkeypatch):
    accel = EmulatedAccelerator()

    def no_pinning(shape, dtype, *, pin=False):
        if pin:
            raise RuntimeError("cannot lock memory")
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(accel, "host_empty", no_pinning)
    with pytest.warns(UserWarning, match="pageable memory"):
        engine = _engine(accel=accel, offload_optimizer={"device": "cpu", "pin_memory": True})
    _one_step(engine)
    assert engine.global_steps == 1


class _NoPinning(EmulatedAccelerator):
    """An accelerator whose page-locked allocations fail, as they do under a low `ulimit -l`."""

    def host_empty(self, shape, dtype, *, pin=False):
        if pin:
            raise RuntimeError("cannot pin memory: locked-memory limit reached")
        return super().host_empty(shape, dtype)


@pytest.mark.parametrize("overlap", [False, True])
def test_buffers_fall_back_to_pageable_memory_when_pinning_fails(overlap):
    config = make_config(2, offload_optimizer={"device": "cpu", "pin_memory": True})
    config["zero_offload"] = {"overlap_offload": overlap}
    with pytest.warns(UserWarning, match="could not pin host memory"):
        engine = zo.initialize(TinyGPT("nano"), config, accelerator=_NoPinning())
    assert not engine.states.flat_grad.is_pinned()
    x = torch.randint(0, 256, (BATCH, SEQ))
    engine.backward(lm_loss(engine(x), x))
    engine.step()
    assert torch.isfinite(engine.states.master).all()
