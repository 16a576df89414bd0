"""A training loop of your own, with a ppdsl schedule inside it.

    torchrun --nproc-per-node 2 examples/train_loop.py --schedule examples/zb_h1.pp --steps 12

Everything around the pipeline is plain torch and yours: the stage modules (here
examples/models/tiny_gpt.py's), the loss, a DataLoader, AdamW, an LR schedule,
logging and a checkpoint. ppdsl compiles and proves the schedule
(`load_schedule`), runs one step's passes per `runner.step(inputs, targets)` and
does the optimizer step the pipeline needs (`OptimizerStep`: clipping by the
global gradient norm, inf/NaN skips, here post-validated as in the zero-bubble
paper). Only the ranks holding the first or the last stage build a data loader:
the inputs go to stage 0, the targets to the last stage; every other rank passes
None. Run with --device cpu on a machine without a GPU per rank.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from ppdsl.runtime import OptimizerStep, PipelineRunner, load_schedule, save_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))
import tiny_gpt  # noqa: E402  (the model: any modules cut into stages would do)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default=str(Path(__file__).parent / "zb_h1.pp"))
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    # The schedule, compiled and checked for this many ranks and microbatches.
    schedule = load_schedule(args.schedule, {"d": world, "m": args.microbatches})
    model = tiny_gpt.stages(schedule.num_stages)
    runner = PipelineRunner(schedule, stages=model.stage, loss_fn=tiny_gpt.loss, device=device)

    # Your optimizer, your LR schedule (a warm-up, then cosine), ppdsl's step.
    optimizer = torch.optim.AdamW(runner.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = 2
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
        (s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(s / args.steps, 1.0)))))
    stepper = OptimizerStep(runner, optimizer, max_norm=1.0, validation="post")

    # Your data: only where it is used. Both data ranks shuffle with the same seed,
    # so stage 0's inputs and the last stage's targets are the same samples.
    batch_size = 2 * schedule.num_microbatches
    batches = None
    if runner.is_first or runner.is_last:
        inputs, targets = tiny_gpt.batch(0, batch_size * args.steps)
        loader = DataLoader(TensorDataset(inputs, targets), batch_size=batch_size,
                            shuffle=True, drop_last=True,
                            generator=torch.Generator().manual_seed(1))
        batches = iter(loader)

    first_loss = last_loss = None
    for step in range(args.steps):
        x = y = None
        if batches is not None:
            x, y = next(batches)
        optimizer.zero_grad()
        loss = runner.step(x if runner.is_first else None, y if runner.is_last else None)
        stepper.step()
        scheduler.step()
        if loss is not None:  # the rank holding the last stage
            value = float(loss)
            first_loss = value if first_loss is None else first_loss
            last_loss = value
            print(f"rank {rank}: step {step + 1}/{args.steps}  loss {value:.4f}  "
                  f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    stepper.resolve()  # the last step, post-validated, is checked here
    if args.checkpoint_dir:
        path = save_checkpoint(Path(args.checkpoint_dir) / f"step-{args.steps:08d}", runner,
                               optimizer, step=args.steps, stepper=stepper, scheduler=scheduler)
        if rank == 0:
            print(f"saved {path}", flush=True)
    if last_loss is not None:
        clipped = sum(o.clipped for o in stepper.outcomes)
        print(f"rank {rank}: loss {first_loss:.4f} -> {last_loss:.4f} in {args.steps} steps "
              f"({clipped} clipped)", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
