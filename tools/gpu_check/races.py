"""Check 3 of `make gpu-check`: the delayed update's Adam waits for the uploads that read what it rewrites.

Under DPU, publish() uploads the new weights by DMA from pinned host memory (the fp32 master itself, or the
fp16 staging buffer the C Adam rounds into) and the next Adam, launched right after, rewrites that memory. The
engine queues that Adam behind the uploads' event (practice/dpu.py). On a fast link the uploads finish long
before Adam gets far, so a missing wait would go unseen; here the uploads are made late on purpose:
  - on CUDA a `torch.cuda._sleep` kernel is queued on the stream ahead of publish()'s copies;
  - on the emulated device the link's copy queue is held until the host queue has run all it can.
Three runs of 6 steps each: pinned host buffers with the late uploads, which must end with the weights of the
same run on pageable buffers (their copies have read their source when they return: no race is possible); and a
control, pinned and late, whose Adam does not wait for the uploads, which must end with other weights. A control
that matches shows the uploads were not late enough to expose a race, and fails the check.

Without the C Adam the fp16 half has no race to find (torch's Adam writes only the fp32 master; publish rounds
it into the staging buffer before the upload), so it is compiled when a compiler exists, and skipped otherwise.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from zero_offload.practice.dpu import DelayedUpdate, DelayedUpdater

from .runs import Setup, deterministic, first_difference, make_config, one_line, say, train

STEPS = 6
SLEEP_CYCLES = 200_000_000  # about 0.1 s at an H200's 2 GHz: many times a small model's CPU Adam


def c_adam_missing() -> str | None:
    """Why the C Adam cannot run here, or None once it is built (compiled now if it was not yet)."""
    from zero_offload.tuning.build import BuildFailed, CompilerNotFound, build

    try:
        build()
    except CompilerNotFound as err:
        return "no cffi" if "cffi is not installed" in str(err) else "no compiler"
    except BuildFailed as err:
        return f"the C Adam did not build ({one_line(err)})"
    return None


@contextlib.contextmanager
def _uploads_held_until_host_quiet(accel, host):
    """Hold the emulated link's copy queue until the host queue has been given its next item (the delayed Adam)
    and can run nothing more: an Adam that does not wait for the uploads has then rewritten their source."""
    hold, failure = accel.dma.hold(), []
    target = host.submitted + 1

    def release_when_quiet():
        try:
            host.wait_quiet(submitted=target)
        except BaseException as err:  # re-raised by the step's thread, never left holding the link
            failure.append(err)
        finally:
            hold.release()

    helper = threading.Thread(target=release_when_quiet, name="gpu-check-late-uploads", daemon=True)
    helper.start()
    try:
        yield
    finally:
        helper.join()
    if failure:
        raise failure[0]


@contextlib.contextmanager
def late_uploads(setup: Setup, *, wait: bool = True):
    """While the block runs, every delayed step that publishes an update and launches the next one publishes
    late (see the module's docstring); `wait=False` also makes the delayed update forget its uploads' event, so
    that its next Adam does not wait for them: the control run."""
    step, finish = DelayedUpdater.step, DelayedUpdate.finish

    def late_step(self, grads, clip_factor, *, skip):
        if skip or self.update.in_flight is None:  # nothing is published, or no Adam follows the publish
            return step(self, grads, clip_factor, skip=skip)
        if not setup.emulated:
            torch.cuda._sleep(SLEEP_CYCLES)  # on the current stream, where publish() queues its copies
            return step(self, grads, clip_factor, skip=skip)
        with _uploads_held_until_host_quiet(self.accel, self.update.host):
            return step(self, grads, clip_factor, skip=skip)

    def finish_forgetting_uploads(self, publish):
        published = finish(self, publish)
        self.uploads = None
        return published

    DelayedUpdater.step = late_step
    if not wait:
        DelayedUpdate.finish = finish_forgetting_uploads
    try:
        yield
    finally:
        DelayedUpdater.step, DelayedUpdate.finish = step, finish


def _dpu_run(setup: Setup, precision: str, *, pin: bool, impl: str, wait: bool = True) -> dict:
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": pin}}
    # No overlap_offload: publish() then uploads every unit at the step, from the memory the next Adam rewrites.
    ext = {"delayed_param_update": {"enabled": True, "start_step": 1}, "cpu_adam": {"impl": impl}}
    with late_uploads(setup, wait=wait):
        return train(setup, make_config(setup, zero, precision=precision, ext=ext), steps=STEPS)


def check_dpu_race(setup: Setup) -> dict:
    """Check 3: with late uploads, DPU on pinned buffers equals DPU on pageable ones, and a control without the
    wait does not (see the module's docstring)."""
    out, problems, missing = {}, [], c_adam_missing()
    with deterministic(setup) as mode:
        for precision in ("fp32", "fp16"):
            if precision == "fp16" and missing:
                out[precision] = {"status": "skipped", "reason": f"skipped: {missing}"}
                say(f"  DPU ({precision}): skipped: {missing} (torch's Adam leaves no race to find)")
                continue
            impl = "torch" if missing else "simd"
            runs = {pin: _dpu_run(setup, precision, pin=pin, impl=impl) for pin in (True, False)}
            control = _dpu_run(setup, precision, pin=True, impl=impl, wait=False)
            differs = first_difference(runs[True]["weights"], runs[False]["weights"])
            caught = first_difference(control["weights"], runs[False]["weights"])
            out[precision] = {
                "adam": impl,
                "equal": differs is None,
                "first_difference": differs,
                "control_without_wait_differs": caught is not None,
                "host_pinned": {"pinned": runs[True]["host_pinned"], "pageable": runs[False]["host_pinned"]},
                "losses": runs[True]["losses"],
                "control_losses": control["losses"],
            }
            if differs is not None:
                problems.append(f"{precision}: pinned and pageable weights differ, first at {differs}")
            if caught is None:
                problems.append(f"{precision}: the control without the wait matched, so the uploads were not "
                                "late enough to show a race: this check proved nothing")  # fmt: skip
            say(f"  DPU pinned vs pageable ({precision}, {impl} Adam): "
                f"{'equal' if differs is None else 'DIFFER at ' + differs}; control without the wait: "
                f"{'differs, as it must' if caught else 'EQUAL (the race was not exposed)'}")  # fmt: skip
    return {"deterministic_kernels": mode, "late_uploads": _how_late(setup), **out, "problems": problems}


def _how_late(setup: Setup) -> str:
    if setup.emulated:
        return "the link's copy queue held until the host queue is quiet"
    return f"torch.cuda._sleep({SLEEP_CYCLES}) ahead of publish()'s copies"
