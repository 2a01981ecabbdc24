"""Walk one gradient through the engine: the project frames on the stack when it reaches the host and its Adam.

Builds the nano TinyGPT at ZeRO stage 2 with the optimizer offloaded, runs one step, and for each landmark (the
gradient copied to the host fp32 buffer, the host Adam's update of that partition, the upload of the new weights)
prints the chain of project functions that led there, from the autograd hook or `Engine.step` down.

    python tools/gradient_walk.py            # the serial path (stage 2, optimizer offloaded)
    python tools/gradient_walk.py --overlap  # the overlapped pipeline (overlap_offload)
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch

import zero_offload as zo
from zero_offload.accelerator import EmulatedAccelerator
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss

PACKAGE = Path(zo.__file__).resolve().parent
# Where a gradient arrives: the first call of any of these ends a walk.
# Matched against the function's qualified name, so that a method named `step` is not every `step`.
LANDMARKS = {
    "to the host": ("gradients_to_host", "OffloadPipeline.receive"),
    "Adam": ("adam_step", "OnePassAdam.update", "OnePassAdam.step", "CPUAdam.step"),
    "back to the device": ("upload_weights", "_adam_then_upload", "publish"),
}


def project_stack(frame) -> list[str]:
    """The project frames on the stack, outermost first, as `path:function`."""
    chain = []
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if PACKAGE in path.parents:
            chain.append(f"{path.relative_to(PACKAGE)}:{frame.f_code.co_name}")
        frame = frame.f_back
    return chain[::-1]


def walk(overlap: bool) -> dict[str, list[str]]:
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 20_000,
            "offload_optimizer": {"device": "cpu"},
        },
        "zero_offload": {"overlap_offload": overlap},
    }
    corpus = torch.frombuffer(bytearray(b"one gradient on its way to the host. " * 40), dtype=torch.uint8)
    x, y = ByteBatches(corpus, 32, seed=1).global_batch(0, 4)
    found: dict[str, list[str]] = {}

    def profile(frame, event, arg):
        if event != "call":
            return
        name = frame.f_code.co_qualname
        for landmark, names in LANDMARKS.items():
            if landmark not in found and any(name == n or name.endswith("." + n) for n in names):
                found[landmark] = project_stack(frame)

    # The pipeline runs the host's work on worker threads, started by initialize: profile those too.
    threading.setprofile(profile)
    engine = zo.initialize(TinyGPT("nano", seed=0), config, accelerator=EmulatedAccelerator())
    sys.setprofile(profile)
    try:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        engine.close()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--overlap", action="store_true", help="the overlapped pipeline instead of the serial path"
    )
    args = parser.parse_args()
    found = walk(args.overlap)
    files: set[str] = set()
    hops = 0
    for landmark in LANDMARKS:
        chain = found.get(landmark)
        if chain is None:
            print(f"{landmark}: not reached")
            continue
        files.update(step.split(":")[0] for step in chain)
        hops += len(chain) - 1
        print(f"{landmark}: {len(chain) - 1} hops")
        for step in chain:
            print(f"    {step}")
    print(f"{hops} hops in all; {len(files)} files on the way: {', '.join(sorted(files))}")


if __name__ == "__main__":
    main()
