"""The engine on a Python that is not the one this project pins: an older torch, a machine without numpy.

A GPU machine often comes with its own torch and runs `make gpu-check` without installing anything. torch 2.13
names the single-tensor collectives `reduce_scatter_single` and `all_gather_single`; releases 2.1 to 2.12 call them
`reduce_scatter_tensor` and `all_gather_into_tensor`. torch does not need numpy, so a bare machine may lack it: the
checkpoint checksums and the NVMe files read tensor bytes without it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist

import zero_offload as zo
from tests.support.distributed import check, run_ranks
from zero_offload.accelerator import EmulatedAccelerator

CONFIG = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-3}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}  # fmt: skip


def _losses(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    engine = zo.initialize(model, CONFIG, accelerator=EmulatedAccelerator())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))[rank * 2 : rank * 2 + 2]
    losses = []
    for _ in range(3):
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


def _with_and_without_the_new_names(rank, world_size):
    with_new = _losses(rank, world_size)
    for name in ("reduce_scatter_single", "all_gather_single"):  # as in torch 2.12 and older
        if hasattr(dist, name):
            delattr(dist, name)
    return with_new, _losses(rank, world_size)


def test_stage3_trains_the_same_with_the_older_names_of_the_collectives():
    for with_new, with_old in check(run_ranks(_with_and_without_the_new_names, 2)):
        assert with_new == with_old


SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["numpy"] = None  # importing numpy fails, as on a machine without it
    import torch
    import zero_offload as zo
    from zero_offload.accelerator import EmulatedAccelerator
    from zero_offload.implementation.checkpoint import consolidate
    out = sys.argv[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    nvme = {"device": "nvme", "nvme_path": out + "/swap"}
    cfg = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "offload_optimizer": nvme},
           "zero_offload": {"cpu_adam": {"impl": "torch"}}}
    engine = zo.initialize(model, cfg, accelerator=EmulatedAccelerator())
    for _ in range(2):
        engine.backward(engine(torch.ones(2, 8)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(out + "/ck")
    engine.load_checkpoint(out + "/ck")
    assert sorted(consolidate(out + "/ck")) == sorted(model.state_dict())
    print("trained, saved and loaded without numpy")
    """
)


def test_nvme_tier_and_checkpoints_work_without_numpy(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "without numpy" in done.stdout
