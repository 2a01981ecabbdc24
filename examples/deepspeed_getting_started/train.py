"""DeepSpeed's getting-started script, run on zero_offload: the one changed line is the import.

    python train.py --deepspeed --deepspeed_config ds_config.json                        # one process
    torchrun --nproc_per_node 2 train.py --deepspeed --deepspeed_config ds_config.json   # two ranks
    torchrun --nproc_per_node 2 train.py --deepspeed --deepspeed_config ds_config.json --resume

It trains the course's TinyGPT on the course's own text, saves a checkpoint every --save-every steps under a tag of
its own with the script's state (its step) as client_state, and with --resume goes on from the latest one.
"""

from __future__ import annotations

import argparse
import json

import torch

import zero_offload.deepspeed as deepspeed  # was: import deepspeed
from zero_offload.workloads import ByteBatches, TinyGPT, lm_loss, load_corpus


def parse_args():
    parser = argparse.ArgumentParser(description="TinyGPT with a DeepSpeed-style script")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in all")
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--save-dir", default="out/ds_getting_started/checkpoints")
    parser.add_argument("--losses", default=None, help="write the losses of this run to this JSON file")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    return parser.parse_args()


class TextWindows(torch.utils.data.Dataset):
    """Windows of the course text as (input, target) byte sequences: a map-style dataset, as DeepSpeed's
    training_data is."""

    def __init__(self, seq_len: int, count: int):
        self.batches = ByteBatches(load_corpus(), seq_len)
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        x, y = self.batches.micro_batch(index, 1)
        return x[0], y[0]


def main():
    args = parse_args()
    deepspeed.init_distributed()
    torch.manual_seed(0)  # the same initial weights on every rank
    net = TinyGPT("nano")
    # Two parameter groups, as fine-tuning scripts build them: the config's weight decay for the weight matrices,
    # none for biases and norms.
    decay = [p for p in net.parameters() if p.dim() >= 2]
    no_decay = [p for p in net.parameters() if p.dim() < 2]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=groups,
        training_data=TextWindows(net.cfg.seq_len, 4096),
    )
    start = 0
    if args.resume:
        path, client_state = engine.load_checkpoint(args.save_dir)
        start = client_state["step"]
        if engine.global_rank == 0:
            print(f"resumed from {path} at step {start}")
    engine.train()
    losses = {}
    for step, (x, y) in enumerate(trainloader):
        if step < start:
            continue  # the batches the checkpointed run already trained on
        if step == args.steps:
            break
        loss = lm_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses[step + 1] = loss.item()
        if (step + 1) % args.save_every == 0:
            engine.save_checkpoint(args.save_dir, tag=f"step{step + 1}", client_state={"step": step + 1})
        if engine.global_rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}, lr {engine.get_lr()[0]:.2e}")
    if args.losses and engine.global_rank == 0:
        with open(args.losses, "w") as file:
            json.dump(losses, file)
    engine.destroy()  # DeepSpeed's name; zo.initialize's scripts call it close()


if __name__ == "__main__":
    main()
