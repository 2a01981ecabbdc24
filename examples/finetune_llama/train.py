"""Fine-tune a small Hugging Face Llama with the zero_offload engine and a DeepSpeed JSON config.

    python examples/finetune_llama/train.py                                  # one process
    torchrun --nproc_per_node 2 examples/finetune_llama/train.py             # two ranks (gloo on the CPU)
    python examples/finetune_llama/train.py --config examples/finetune_llama/ds_config_stage3.json
    python examples/finetune_llama/train.py --steps 300 --resume             # continue from the newest checkpoint

The model is built from a config (nothing is downloaded); its tokenizer is the identity on bytes, so the
course's own text (zero_offload.workloads.load_corpus) is the data. At the end the weights are exported with
`save_pretrained` and loaded back with `from_pretrained`, which generates a few bytes of text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

import zero_offload as zo
from zero_offload.workloads import ByteBatches, load_corpus

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(HERE / "ds_config.json"), help="DeepSpeed-style JSON config")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps to train in all")
    parser.add_argument("--out", default="out/examples/finetune_llama", help="checkpoints and the HF export")
    parser.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (0: never)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--micro-batch", type=int, help="overrides train_micro_batch_size_per_gpu")
    parser.add_argument("--seq-len", type=int, default=128, help="bytes per training sequence")
    return parser.parse_args()


def build_model(seq_len: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)  # the same initial weights on every rank
    config = LlamaConfig(
        vocab_size=256,  # one token per byte
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(seq_len, 256),
        tie_word_embeddings=True,  # one tensor under two names: trained and counted once
    )
    return LlamaForCausalLM(config)


def load_ds_config(args: argparse.Namespace) -> dict:
    ds = json.loads(Path(args.config).read_text())
    if args.micro_batch:
        ds["train_micro_batch_size_per_gpu"] = args.micro_batch  # accumulation is derived from it
    if "total_num_steps" in ds.get("scheduler", {}).get("params", {}):
        ds["scheduler"]["params"]["total_num_steps"] = args.steps  # the decay ends where training does
    return ds


def micro_batches(engine, data: ByteBatches, index: int):
    """This rank's rows of global batch `index`, one micro-batch per accumulation step."""
    cfg, comm = engine.config, engine.comm
    for k in range(cfg.gradient_accumulation_steps):
        x, _ = data.micro_batch(index, cfg.train_micro_batch_size_per_gpu, micro_step=k, rank=comm.rank,
                                world_size=comm.world_size, accumulation=cfg.gradient_accumulation_steps)  # fmt: skip
        yield x


def mean_over_ranks(engine, value: float) -> float:
    return engine.comm.sum(value) / engine.comm.world_size


@torch.no_grad()
def evaluate(engine, data: ByteBatches, batches: int = 4) -> float:
    """The mean loss over the same `batches` global batches of held-out text, every time."""
    rows = [x for index in range(batches) for x in micro_batches(engine, data, index)]
    losses = [engine(input_ids=x, labels=x).loss.item() for x in rows]
    return mean_over_ranks(engine, sum(losses) / len(losses))


def decay_groups(model: torch.nn.Module) -> list[dict]:
    """Two parameter groups, as Hugging Face's Trainer builds them: weight decay for the weight matrices (the
    config's), none for the 1-d parameters (the RMSNorm scales; biases, in models that have them)."""
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    return [{"params": decay, "name": "decay"}, {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def newest_checkpoint(root: Path) -> Path | None:
    # `latest` is written last, once every rank's file and meta.json are in place: without it, a save is unfinished.
    done = [p.parent for p in root.glob("step_*/latest")]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def main() -> None:
    args = parse_args()
    out, ckpts = Path(args.out), Path(args.out) / "checkpoints"
    newest = newest_checkpoint(ckpts)
    if args.resume and newest is None:
        raise SystemExit(f"--resume: no complete checkpoint under {ckpts}; train without --resume first")
    if newest is not None and not args.resume:
        raise SystemExit(f"{ckpts} holds checkpoints of an earlier run: pass --resume, or another --out")

    model = build_model(args.seq_len)
    # Under torchrun this joins the process group. The config's weight_decay for the matrices, none for the norms.
    engine = zo.initialize(model, load_ds_config(args), param_groups=decay_groups(model))
    rank, world, stage = engine.comm.rank, engine.comm.world_size, engine.config.zero_optimization.stage
    say = tqdm.write if rank == 0 else (lambda text: None)
    if args.resume:
        engine.load_checkpoint(newest)  # saved at any world size: the shards are re-cut for this one
        say(f"resumed from {newest} at step {engine.global_steps}")

    corpus = load_corpus()
    train, val = ByteBatches(corpus, args.seq_len), ByteBatches(corpus, args.seq_len, split="val")
    accumulation = engine.gradient_accumulation_steps
    tokens_per_step = engine.config.train_batch_size * args.seq_len
    desc = f"{engine.num_params / 1e6:.2f}M-param Llama, {world} rank(s), stage {stage}"
    first = engine.global_steps
    say(f"validation loss at step {first}: {evaluate(engine, val):.3f}")
    with tqdm(total=args.steps, initial=first, desc=desc, unit="step", disable=rank != 0) as bar:
        for step in range(first, args.steps):
            start, total = time.perf_counter(), 0.0
            for x in micro_batches(engine, train, step):
                loss = engine(input_ids=x, labels=x).loss  # the model shifts the labels by one itself
                engine.backward(loss)
                engine.step()  # updates at the last micro-batch of the step only
                total += loss.item() / accumulation
            loss = mean_over_ranks(engine, total)
            bar.update(1)
            speed = tokens_per_step / (time.perf_counter() - start)
            bar.set_postfix({"loss": f"{loss:.3f}", "tokens/s": f"{speed:,.0f}"})
            if args.save_every and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
                engine.save_checkpoint(ckpts / f"step_{step + 1}")  # every rank writes its own shard
                say(f"step {step + 1}: saved {ckpts / f'step_{step + 1}'}")

    val_loss, report = evaluate(engine, val), engine.memory_report()
    say(f"validation loss at step {engine.global_steps}: {val_loss:.3f}\n{report}")

    export(engine, model, out / "hf")
    engine.close()  # stops the engine's threads and leaves the process group zo.initialize joined


def export(engine, model: LlamaForCausalLM, path: Path) -> None:
    """save_pretrained on every rank (at stage 3 state_dict() gathers the full weights one module at a time,
    a collective); rank 0 writes, then loads the copy back with from_pretrained and generates from it."""
    model.config.use_cache = True  # activation checkpointing turned the key/value cache off for training
    weights = engine.consolidated_state_dict()  # the same full weights, to check the copy against
    model.save_pretrained(path, is_main_process=engine.comm.rank == 0)
    if engine.comm.rank != 0:
        return
    loaded = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    state = loaded.state_dict()
    same = state.keys() == weights.keys() and all(
        torch.equal(state[k].to(w.dtype), w) for k, w in weights.items()
    )
    if not same:
        raise SystemExit(f"{path} does not hold the trained weights")
    with torch.no_grad():
        tokens = loaded.generate(torch.tensor([list(b"The CPU ")]), max_new_tokens=48, do_sample=False)
    # Bytes, not characters: a multi-byte character cut at the end shows as a replacement mark.
    text = bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
    tqdm.write(f"exported to {path}; from_pretrained loads it and generates:\n  {text!r}")


if __name__ == "__main__":
    main()
