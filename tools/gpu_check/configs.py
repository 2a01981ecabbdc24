"""Check 1 of `make gpu-check`: every offload configuration trains like the same model all on the device.

Each configuration runs 4 steps and is compared with a stage-0 run (no sharding, no offload) of the same model,
precision and batches: its final weights, what forward reads, must end near the reference's. The distance is
relative to how far the reference moved:

    error = ||w - w_ref|| / ||w_ref - w_0||      (over every floating tensor of the model's state_dict)

so an engine that never uploads its new weights (w = w_0) scores 1.0 whatever the model and the learning rate,
and a correct one scores 0 up to rounding. Each precision has its tolerance (TOLERANCE), stated in the results.

The delayed parameter update (DPU) cannot match the reference closely: from its second delayed step on, each
gradient was computed on weights one update old. But it applies the same number of updates as the reference, so
it still ends near it, only less near (DPU_TOLERANCE); a DPU that never uploads stays at w_0 and scores 1.0.
That tolerance catches uploads that never happen, not one lost update (which scores about 0.25 here, where the
staleness alone scores 0.13): whether the delayed update's uploads are exact is check 3's (races.py).
"""

from __future__ import annotations

import math

import torch

from zero_offload.workloads import TinyGPT

from .runs import PINNED, Setup, dpu, hf_model, make_config, median, one_line, overlap, say, train

# Measured against stage 0: equal on the emulated device (both compute in fp32); on a GPU the offloaded Adam and
# the device's differ in the last bits, which low-precision weights and Adam's normalised first steps amplify.
TOLERANCE = {"fp32": 0.02, "fp16": 0.1, "bf16": 0.2}
DPU_TOLERANCE = (
    0.5  # measured 0.13 on the emulated device (fp16, start_step 1, 4 steps); never uploading: 1.0
)
STEPS = 4


def configurations(setup: Setup) -> dict[str, tuple[dict, str]]:
    """Check 1's configurations: name -> (engine config, the name of its reference in `references`)."""
    nvme = {"device": "nvme", "nvme_path": str(setup.scratch / "nvme"), "buffer_count": 2}
    stage2 = {"stage": 2, "offload_optimizer": PINNED}
    return {
        "stage2_offload_pinned": (make_config(setup, stage2), "stage0_fp16"),
        "stage2_offload_overlap": (make_config(setup, stage2, ext=overlap()), "stage0_fp16"),
        "stage2_offload_dpu": (make_config(setup, stage2, ext=dpu()), "stage0_fp16"),
        "stage3_offload_param": (
            make_config(setup, {"stage": 3, "offload_optimizer": PINNED, "offload_param": PINNED}),
            "stage0_fp16",
        ),
        "partial_offload_0.5": (
            make_config(setup, {"stage": 2, "offload_optimizer": {**PINNED, "ratio": 0.5}}),
            "stage0_fp16",
        ),
        "nvme_offload": (
            make_config(
                setup, {"stage": 2, "offload_optimizer": nvme, "sub_group_size": setup.sub_group_size}
            ),
            "stage0_fp16",
        ),
        "bf16_recompute": (
            make_config(setup, stage2, precision="bf16", activation_checkpointing={}),
            "stage0_bf16",
        ),
        "hf_gpt2": (make_config(setup, stage2, precision="fp32"), "stage0_fp32_hf"),
    }


def references(setup: Setup) -> dict[str, dict]:
    return {
        "stage0_fp16": make_config(setup, {"stage": 0}),
        "stage0_bf16": make_config(setup, {"stage": 0}, precision="bf16"),
        "stage0_fp32_hf": make_config(setup, {"stage": 0}, precision="fp32"),
    }


def precision_of(config: dict) -> str:
    return next((p for p in ("fp16", "bf16") if config.get(p, {}).get("enabled")), "fp32")


def tolerance(config: dict) -> float:
    if config["zero_offload"].get("delayed_param_update", {}).get("enabled"):
        return DPU_TOLERANCE
    return TOLERANCE[precision_of(config)]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: t.detach().float().cpu().clone() for n, t in model.state_dict().items() if t.is_floating_point()
    }


def relative_error(weights: dict, reference: dict, initial: dict) -> float:
    """||w - w_ref|| / ||w_ref - w_0|| over the tensors of `initial`; inf if the reference did not move."""
    diff = math.sqrt(sum(float((weights[n] - reference[n]).pow(2).sum()) for n in initial))
    moved = math.sqrt(sum(float((reference[n] - initial[n]).pow(2).sum()) for n in initial))
    return diff / moved if moved > 0 else math.inf


def _model(setup: Setup, reference: str):
    """A fresh model for a run against `reference` (the same initial weights every time), or None and why not."""
    if reference.endswith("_hf"):
        return hf_model()
    return TinyGPT(setup.model), None


def check_configurations(setup: Setup) -> dict:
    """Check 1: each configuration ends within its tolerance of its stage-0 reference; each is tried even if
    another fails. A reference that fails fails the configurations compared with it; one that cannot run here
    (no transformers) skips them."""
    cases, results, problems = configurations(setup), {}, []
    refs, missing = (
        {},
        {},
    )  # reference name -> (initial weights, run); -> (status, reason) where it did not run
    for name, config in references(setup).items():
        if not any(ref == name for _, ref in cases.values()):
            continue
        try:
            model, why = _model(setup, name)
            if model is None:
                missing[name] = ("skipped", f"skipped: {why}")
                continue
            refs[name] = snapshot(model), train(setup, config, model=model, steps=STEPS)
            say(f"  {name:<24} reference  losses {' '.join(f'{v:.4f}' for v in refs[name][1]['losses'])}")
        except Exception as err:  # the configurations compared with it say so
            missing[name] = ("failed", f"its reference {name} failed: {one_line(err)}")
            problems.append(missing[name][1])
    for name, (config, ref) in cases.items():
        if ref in missing:
            status, reason = missing[ref]
            results[name] = {"status": status, "reason": reason}
            say(f"  {name:<24} {reason}")
            continue
        try:
            results[name] = _compare(setup, name, config, ref, refs[ref])
            if results[name]["status"] == "failed":
                problems.append(f"{name}: {results[name]['reason']}")
        except Exception as err:  # one configuration's failure must not hide the others' results
            results[name] = {"status": "failed", "error": one_line(err)}
            problems.append(f"{name}: {one_line(err)}")
            say(f"  {name:<24} FAILED: {one_line(err)}")
    return {"configurations": results, "problems": problems}


def _compare(setup: Setup, name: str, config: dict, ref: str, reference: tuple[dict, dict]) -> dict:
    initial, ref_run = reference
    model, _ = _model(setup, ref)
    run = train(setup, config, model=model, steps=STEPS)
    weights = run.pop("weights")
    error, tol = relative_error(weights, ref_run["weights"], initial), tolerance(config)
    finite = all(math.isfinite(v) for v in run["losses"])
    run.update(
        reference=ref,
        relative_error=round(error, 6),
        tolerance=tol,
        max_loss_difference=round(
            max(abs(a - b) for a, b in zip(run["losses"], ref_run["losses"], strict=True)), 6
        ),
        median_ms_per_step=median(run["ms_per_step"]),
    )
    run["status"] = "passed" if finite and error <= tol else "failed"
    if not finite:
        run["reason"] = f"losses {run['losses']}"
    elif not error <= tol:  # NaN too
        run["reason"] = f"weights {error:.3g} of the reference's movement away from it (tolerance {tol})"
    say(f"  {name:<24} {run['median_ms_per_step']:9.1f} ms/step  error {error:.2e} (tolerance {tol})  "
        f"losses {' '.join(f'{v:.4f}' for v in run['losses'])}{'  FAILED' if run['status'] == 'failed' else ''}")  # fmt: skip
    return run
