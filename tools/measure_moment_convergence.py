"""Train with fp32, bf16 and 8-bit Adam moments on the host and keep the losses for the course to quote.

    python tools/measure_moment_convergence.py                 # all runs; course/measured/moment-convergence.*
    python tools/measure_moment_convergence.py --quick         # 40 steps, one seed: does it work at all
    python tools/measure_moment_convergence.py --print X.json  # measure nothing: print and plot X.json

Three workloads, each trained with `"zero_offload": {"cpu_adam": {"states": ...}}` set to "fp32", "bf16" and
"int8" and three seeds (initial weights and data order), ZeRO stage 2 with the optimizer offloaded to the CPU
and the C Adam, on the emulated device:
- `tinygpt`: TinyGPT "tiny" (0.84M parameters), 500 steps of 16 x 64 bytes, AdamW, fp32 compute;
- `tinygpt-fp16`: the same in fp16 with dynamic loss scaling (the skipped steps are counted);
- `llama`: the Hugging Face Llama of examples/finetune_llama (its model, its DeepSpeed JSON: bf16, WarmupDecayLR,
  clipping), 200 steps.

The measure is the validation loss at the end (the same held-out batches for every run of a workload), and the
mean training loss of the last 20 steps. The .json keeps every loss of every step (the figure draws them); the
.txt is the summary the course quotes. Runs take one core each, two at a time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16", "int8")
SEEDS = (0, 1, 2)
STEPS = {"tinygpt": 500, "tinygpt-fp16": 500, "llama": 200}
GOAL = 0.01  # the bar: final loss within 1% of fp32 states


def _llama_example():
    """examples/finetune_llama/train.py as a module: its model and its config, not a copy of them."""
    spec = importlib.util.spec_from_file_location("finetune_llama", REPO / "examples/finetune_llama/train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llama_loss(engine, x, y):
    return engine(input_ids=x, labels=x).loss  # the model shifts the labels itself


def _run(job: tuple[str, str, int, int]) -> dict:
    """One training run in a fresh process: one thread, no process group."""
    workload, precision, seed, steps = job
    import torch

    torch.set_num_threads(1)
    from zero_offload.lessons.tuning_moments import train_tinygpt, train_with_moments
    from zero_offload.workloads import ByteBatches, load_corpus

    corpus = load_corpus()
    if workload == "llama":
        example, seq_len = _llama_example(), 128
        model = example.build_model(seq_len, seed=seed)
        config = json.loads((REPO / "examples/finetune_llama/ds_config.json").read_text())
        config["scheduler"]["params"]["total_num_steps"] = steps
        config["zero_offload"] = {"cpu_adam": {"impl": "simd", "threads": 1, "states": precision}}
        train, held_out = ByteBatches(corpus, seq_len, seed=seed), ByteBatches(corpus, seq_len, split="val")
        result = train_with_moments(model, config, train, held_out, llama_loss, steps,
                                    param_groups=example.decay_groups(model))  # fmt: skip
    else:
        result = train_tinygpt(
            precision, seed=seed, steps=steps, corpus=corpus, fp16=workload.endswith("fp16")
        )
    return {"workload": workload, "precision": precision, "seed": seed, **result}


def summarize(runs: list[dict]) -> dict:
    """Per workload and precision: mean and spread over the seeds, and the gap to fp32 (mean, and each seed's)."""
    summary = {}
    for workload in dict.fromkeys(r["workload"] for r in runs):
        rows = {p: sorted((r for r in runs if r["workload"] == workload and r["precision"] == p),
                          key=lambda r: r["seed"]) for p in PRECISIONS}  # fmt: skip
        base = {r["seed"]: r["val_loss"] for r in rows["fp32"]}
        summary[workload] = {}
        for precision, group in rows.items():
            vals = [r["val_loss"] for r in group]
            if not vals:
                continue
            mean = statistics.fmean(vals)
            paired = [r["val_loss"] / base[r["seed"]] - 1 for r in group if r["seed"] in base]
            summary[workload][precision] = {
                "seeds": [r["seed"] for r in group],
                "val_loss": vals,
                "val_mean": mean,
                "val_spread": max(vals) - min(vals),
                "val_stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                "last_mean": statistics.fmean(r["last_loss"] for r in group),
                "gap_of_means": mean / statistics.fmean(base.values()) - 1 if base else None,
                "gap_per_seed": paired,
                "skipped_steps": [r["skipped_steps"] for r in group],
                "host_optimizer_bytes_per_param": group[0]["host_optimizer_bytes_per_param"],
            }
    return summary


def printed(result: dict) -> str:
    lines = [f"CPU: {result['machine']['cpu']}; C Adam variant: {result['machine']['kernel_variant']}"]
    lines.append(result["command"])
    lines.append("final loss: validation loss after the last step, mean of 8 held-out batches")
    for workload, rows in result["summary"].items():
        lines.append(f"\n{workload} ({_about(result, workload)}):")
        lines.append(
            f"  {'states':<6} {'bytes/param':>11} {'val loss, mean':>15} {'spread':>8} {'vs fp32':>8}"
            f" {'per seed vs fp32':>24} {'last-20 train':>14} {'skipped':>8}"
        )
        for precision, row in rows.items():
            gap = "" if precision == "fp32" else f"{row['gap_of_means']:+.2%}"
            seeds = "" if precision == "fp32" else " ".join(f"{g:+.2%}" for g in row["gap_per_seed"])
            skipped = "/".join(str(s) for s in row["skipped_steps"])
            lines.append(
                f"  {precision:<6} {row['host_optimizer_bytes_per_param']:>11.3f} {row['val_mean']:>15.4f}"
                f" {row['val_spread']:>8.4f} {gap:>8} {seeds:>24} {row['last_mean']:>14.4f} {skipped:>8}"
            )
    return "\n".join(lines) + "\n"


def _about(result: dict, workload: str) -> str:
    run = next(r for r in result["runs"] if r["workload"] == workload)
    seeds = sorted({r["seed"] for r in result["runs"] if r["workload"] == workload})
    return (
        f"{run['num_params'] / 1e6:.2f}M parameters, {run['steps']} steps, seeds {', '.join(map(str, seeds))}"
    )


def plot(result: dict, path: Path) -> Path:
    """The course's figure of `result` (tools/figures/moment_convergence.py draws it; so does
    `python -m tools.draw_figures`, from the committed .json)."""
    import matplotlib

    if str(REPO) not in sys.path:  # run as a script, tools/ is on the path but the repository is not
        sys.path.insert(0, str(REPO))
    from tools.figures.moment_convergence import draw_result

    with matplotlib.rc_context(matplotlib.rcParamsDefault):
        matplotlib.use("Agg")
        return draw_result(result, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "course" / "measured" / "moment-convergence.json")
    parser.add_argument("--figure", type=Path, default=REPO / "course" / "figures" / "moment-convergence.png")
    parser.add_argument(
        "--print", dest="source", type=Path, help="print and plot a results file; measure nothing"
    )
    parser.add_argument("--quick", action="store_true", help="40 steps, seed 0: check that it runs")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    if args.source is not None:
        result = json.loads(args.source.read_text())
        print(printed(result), end="")
        print(f"drew {plot(result, args.figure)}", file=sys.stderr)
        return 0

    from tqdm import tqdm

    from zero_offload.cli.bench.cpu import machine
    from zero_offload.cli.bench.run import write_measured

    seeds = SEEDS[:1] if args.quick else SEEDS
    jobs = [(w, p, s, 40 if args.quick else n) for w, n in STEPS.items() for s in seeds for p in PRECISIONS]
    with ProcessPoolExecutor(args.workers) as pool:
        runs = list(tqdm(pool.map(_run, jobs), total=len(jobs), desc="training runs", unit="run"))
    result = {
        "command": "python tools/measure_moment_convergence.py" + (" --quick" if args.quick else ""),
        "machine": machine(),
        "summary": summarize(runs),
        "runs": runs,
    }
    json_file, text_file = write_measured(args.out, result, printed(result))
    print(f"wrote {json_file}, {text_file} and {plot(result, args.figure)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
