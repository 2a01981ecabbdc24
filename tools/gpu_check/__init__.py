"""`make gpu-check`: one prepared smoke test of the engine's CUDA path, a few minutes on one GPU.

    PYTHONPATH=src python -m tools.gpu_check [--out out/gpu-check] [--only NAME,NAME] [--emulated]

Run it from the repository root (where the package ``tools`` is found); ``PYTHONPATH=src`` is for a bare
checkout, where zero_offload is not installed. The checks live one group to a module: configs, runs, races,
device and dist; this module runs them and records what they found.

Each check runs on its own: a failing one is recorded with its error and the rest still run. The figures are
printed as they come and written, after every check, to OUT/results.json. Exit status 1 if any check failed.
Without torch, or without a CUDA device, it says so in one line and exits 0.

Most checks compare and can fail; bandwidth, adam_vs_gpu and serial_vs_overlap only measure, and are recorded
as "reported" (not checked). Checks not started within --budget seconds are skipped; on CUDA a skipped sanitizer,
or a skipped check that compares, counts as failed.

--emulated runs the engine checks on the emulated device with tiny models, so that the script itself is tested
on machines without a GPU; the checks that need CUDA are recorded as skipped.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import tempfile
import time
import traceback
from pathlib import Path

CHECKS = (  # name, module of this package, function: looked up when run, so a test can replace one
    ("torch_api", "dist", "check_torch_api"),
    ("one_gpu_per_rank", "dist", "check_one_gpu_per_rank"),
    # Early: the slowest of the checks that prove something, so that the budget never leaves it out.
    ("sanitizer", "device", "check_sanitizer"),
    ("configurations", "configs", "check_configurations"),
    ("overlap_equal", "runs", "check_overlap_equal"),
    ("dpu_race", "races", "check_dpu_race"),
    ("oom_hint", "device", "check_oom"),
    ("two_ranks", "dist", "check_two_ranks"),
    # Last: they measure and report, with nothing to fail on, so the budget may leave them out.
    ("bandwidth", "device", "check_bandwidth"),
    ("adam_vs_gpu", "device", "check_adam_vs_gpu"),
    ("serial_vs_overlap", "device", "check_serial_vs_overlap"),
)
REPORTED = {"bandwidth", "adam_vs_gpu", "serial_vs_overlap"}  # numbers only: "reported, not checked"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/gpu-check", help="directory for results.json")
    parser.add_argument("--emulated", action="store_true", help="run on the emulated CPU device, tiny models")
    parser.add_argument(
        "--only", default="", help="comma-separated check names: " + ", ".join(c[0] for c in CHECKS)
    )
    parser.add_argument("--budget", type=float, default=290.0,
                        help="seconds for the whole run; checks not started by then are skipped")  # fmt: skip
    parser.add_argument("--sanitizer-child", action="store_true", help=argparse.SUPPRESS)
    # One rank of the two_ranks check; the path is where it leaves its weights.
    parser.add_argument("--ranks-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {c[0] for c in CHECKS})
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(c[0] for c in CHECKS)}")
    return args, names


def describe_error(err: BaseException) -> str:
    """The error in two lines at most: its type and first line, and where in the project it was raised."""
    text = str(err).strip().splitlines()
    head = f"{type(err).__name__}: {text[0][:300] if text else ''}"
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "site-packages" not in f.filename]
    if frames:
        head += f"\n  at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}"
    return head


def plain(value):
    """JSON without NaN or Infinity tokens, which strict readers refuse: a non-finite figure becomes a string."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def run_check(name: str, module: str, function: str, setup) -> dict:
    started = time.perf_counter()
    try:
        result = getattr(importlib.import_module(f"{__name__}.{module}"), function)(setup)
        done = "reported" if name in REPORTED else "passed"
        status = result.get("status") or ("failed" if result.get("problems") else done)
        result = {"status": status, **{k: v for k, v in result.items() if k != "status"}}
    except Exception as err:  # recorded, and the next check runs
        result = {"status": "failed", "error": describe_error(err)}
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def verdict(name: str, result: dict, *, emulated: bool) -> dict:
    """The result as it counts. On a GPU a skip proves nothing: a check that proves something and was left out
    by the budget fails there, and so does a skipped sanitizer, whatever the reason (a race the sanitizer would
    have reported is exactly what must not pass unseen). On the emulated device skips are expected."""
    if emulated or result["status"] != "skipped" or name in REPORTED:
        return result
    if name == "sanitizer" or result.get("budget_spent"):
        return {
            **result,
            "status": "failed",
            "reason": f"failed: {result.get('reason')} (a skip on CUDA fails)",
        }
    return result


def make_setup(args, scratch: Path, deadline: float):
    from .device import accelerator
    from .runs import Setup

    if args.emulated:
        return Setup(accelerator(True), True, "nano", "tiny", 4, 4, scratch, 20_000, deadline)
    return Setup(accelerator(False), False, "small", "100m", 16, 10, scratch, 1_000_000, deadline)


def main(argv=None) -> int:
    args, only = parse_args(argv)
    deadline = time.monotonic() + args.budget
    try:
        import torch
    except Exception as err:
        print(f"gpu-check: torch cannot be imported ({err}); nothing to check.")
        return 0
    if not args.emulated and not torch.cuda.is_available():
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device; nothing to check (--emulated tries "
              "the checks on the emulated CPU device).")  # fmt: skip
        return 0
    if not args.emulated:
        # cuBLAS reads this when it starts; without it a deterministic run refuses cuBLAS matmuls.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.sanitizer_child:
        from .device import sanitizer_child

        return sanitizer_child()
    if args.ranks_child:
        from .dist import ranks_child

        return ranks_child(make_setup(args, args.ranks_child.parent, deadline), args.ranks_child)
    from .device import environment
    from .runs import say

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        env = environment(args.emulated)
    except Exception as err:  # the checks may still tell what is wrong
        env = {"error": describe_error(err)}
    results = {"environment": env, "checks": {}}
    kernel = env.get("c_kernel", {}).get("variant") or "unavailable (torch's Adam instead)"
    say(f"gpu-check on {env.get('device')}: torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"CPU {env.get('cpu_model')}, cffi {env.get('cffi')}, C Adam {kernel}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        setup = make_setup(args, Path(scratch), deadline)
        for name, module, function in CHECKS:
            if only and name not in only:
                continue
            say(f"[{name}]")
            if time.monotonic() > deadline:
                result = {
                    "status": "skipped",
                    "reason": f"skipped: the run's budget of {args.budget:.0f} s was spent",
                    "budget_spent": True,
                    "seconds": 0.0,
                }
            else:
                result = run_check(name, module, function, setup)
            result = verdict(name, result, emulated=args.emulated)
            results["checks"][name] = result
            if result["status"] == "reported":
                say("  -> reported, not checked")
            elif result["status"] != "passed":
                detail = result.get("error") or result.get("reason") or "; ".join(result.get("problems", []))
                say(
                    f"  -> {detail}"
                    if detail.startswith(result["status"])
                    else f"  -> {result['status']}: {detail}"
                )
            (out / "results.json").write_text(json.dumps(plain(results), indent=1) + "\n")
    statuses = [result["status"] for result in results["checks"].values()]
    failed = [name for name, result in results["checks"].items() if result["status"] == "failed"]
    results["failed"] = failed
    (out / "results.json").write_text(json.dumps(plain(results), indent=1) + "\n")
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in ("passed", "reported", "skipped") if s in statuses)
    say(f"gpu-check: {counts or 'nothing run'} (reported: figures only, not checked)"
        f"{'; failed: ' + ', '.join(failed) if failed else ''}; figures in {out / 'results.json'}")  # fmt: skip
    return 1 if failed else 0
