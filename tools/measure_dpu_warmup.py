"""How long should the delayed parameter update (DPU) wait? Train with several `start_step` values and keep the
losses for the course to quote.

    python tools/measure_dpu_warmup.py                 # all runs; course/measured/dpu-warmup.{json,txt}
    python tools/measure_dpu_warmup.py --quick         # 30 steps, one seed, two settings: does it work at all
    python tools/measure_dpu_warmup.py --print X.json  # measure nothing: print X.json's summary

TinyGPT "tiny" (0.83M parameters), batches of 16 x 64 bytes, AdamW lr 2e-3 with clipping at 1.0, ZeRO stage 2
with the optimizer offloaded to the CPU and the C Adam on one thread (fp32 moments), on the emulated device:
the setup of tools/measure_moment_convergence.py. Each run adds
`"zero_offload": {"delayed_param_update": {"enabled": true, "start_step": N}}` for N in START_STEPS, or no DPU at
all, with three seeds (initial weights and data order). From step N on, step t's gradient is computed on the
weights of step t-1 (the update runs one step late); the steps before N are synchronous.

The measure is the validation loss after the last step (the same 8 held-out batches for every run), the mean
training loss of the last 20 steps, and the mean of the first 50 (where a late update hurts most). The .json keeps
every loss of every step; the .txt is the summary the course quotes. Runs take one core each, two at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START_STEPS = (None, 0, 10, 40)  # None: no DPU
SEEDS = (0, 1, 2)
STEPS = 300
EARLY = 50  # the first steps, averaged: where starting the delay too early shows


def label(start: int | None) -> str:
    return "no DPU" if start is None else f"start_step {start}"


def _run(job: tuple[int | None, int, int]) -> dict:
    """One training run in a fresh process: one thread, no process group."""
    start, seed, steps = job
    import torch

    torch.set_num_threads(1)
    from zero_offload.lessons.tuning_moments import moment_config, tinygpt_loss, train_with_moments
    from zero_offload.workloads import ByteBatches, TinyGPT, gpt_config, load_corpus

    corpus = load_corpus()
    cfg = gpt_config("tiny")
    config = moment_config("fp32")
    if start is not None:
        config["zero_offload"]["delayed_param_update"] = {"enabled": True, "start_step": start}
    train = ByteBatches(corpus, cfg.seq_len, seed=seed)
    held_out = ByteBatches(corpus, cfg.seq_len, split="val")  # the same held-out batches for every run
    result = train_with_moments(TinyGPT(cfg, seed=seed), config, train, held_out, tinygpt_loss, steps)
    return {"start_step": start, "seed": seed, **result}


def summarize(runs: list[dict]) -> dict:
    """Per setting: mean over the seeds and the gap to no DPU (of the means, and each seed's)."""
    base = {r["seed"]: r["val_loss"] for r in runs if r["start_step"] is None}
    summary = {}
    for start in dict.fromkeys(r["start_step"] for r in runs):
        group = sorted((r for r in runs if r["start_step"] == start), key=lambda r: r["seed"])
        vals = [r["val_loss"] for r in group]
        mean = statistics.fmean(vals)
        early = min(EARLY, len(group[0]["losses"]))
        summary[label(start)] = {
            "start_step": start,
            "seeds": [r["seed"] for r in group],
            "val_loss": vals,
            "val_mean": mean,
            "val_spread": max(vals) - min(vals),
            "last_mean": statistics.fmean(r["last_loss"] for r in group),
            "early_mean": statistics.fmean(statistics.fmean(r["losses"][:early]) for r in group),
            "gap_of_means": mean / statistics.fmean(base.values()) - 1 if base else None,
            "gap_per_seed": [r["val_loss"] / base[r["seed"]] - 1 for r in group if r["seed"] in base],
        }
    return summary


def printed(result: dict) -> str:
    runs = result["runs"]
    seeds = sorted({r["seed"] for r in runs})
    lines = [f"CPU: {result['machine']['cpu']}; C Adam variant: {result['machine']['kernel_variant']}"]
    lines.append(result["command"])
    lines.append(
        f'TinyGPT "tiny" ({runs[0]["num_params"] / 1e6:.2f}M parameters), {runs[0]["steps"]} steps, '
        f"seeds {', '.join(map(str, seeds))}; stage 2 + CPU offload, AdamW lr 2e-3"
    )
    lines.append("final loss: validation loss after the last step, mean of 8 held-out batches")
    lines.append(f"first-{EARLY} train: mean training loss of the first {EARLY} steps, mean of seeds\n")
    lines.append(
        f"  {'setting':<14} {'val loss, mean':>15} {'spread':>8} {'vs no DPU':>10} {'per seed vs no DPU':>26}"
        f" {f'first-{EARLY} train':>15} {'last-20 train':>14}"
    )
    for name, row in result["summary"].items():
        gap = "" if row["start_step"] is None else f"{row['gap_of_means']:+.2%}"
        per = "" if row["start_step"] is None else " ".join(f"{g:+.2%}" for g in row["gap_per_seed"])
        lines.append(
            f"  {name:<14} {row['val_mean']:>15.4f} {row['val_spread']:>8.4f} {gap:>10} {per:>26}"
            f" {row['early_mean']:>15.4f} {row['last_mean']:>14.4f}"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "course" / "measured" / "dpu-warmup.json")
    parser.add_argument(
        "--print", dest="source", type=Path, help="print a results file's summary; measure nothing"
    )
    parser.add_argument(
        "--quick", action="store_true", help="30 steps, seed 0, no DPU and start_step 10: check that it runs"
    )
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    if args.source is not None:
        print(printed(json.loads(args.source.read_text())), end="")
        return 0

    from zero_offload.cli.bench.cpu import machine
    from zero_offload.cli.bench.run import write_measured

    if args.quick:
        jobs = [(start, 0, 30) for start in (None, 10)]
    else:
        jobs = [(start, seed, STEPS) for seed in SEEDS for start in START_STEPS]
    with ProcessPoolExecutor(args.workers) as pool:
        runs = list(pool.map(_run, jobs))
    result = {
        "command": "python tools/measure_dpu_warmup.py" + (" --quick" if args.quick else ""),
        "machine": machine(),
        "summary": summarize(runs),
        "runs": runs,
    }
    json_file, text_file = write_measured(args.out, result, printed(result))
    print(f"wrote {json_file} and {text_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
