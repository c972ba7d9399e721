"""A plain training script on pipedream_fast: run it with torchrun or pipedream-fast run.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py --schedule pipedream
    pipedream-fast run --nproc 3 examples/torchrun_train.py --replicate-first --schedule 2bw,1f1b

The model is cut into two stages at a fixed block; with --replicate-first and 3 ranks the first
stage runs on ranks 0 and 1 and the second on rank 2. `--schedule` takes a comma-separated
list: each schedule trains a fresh copy of the model in turn. Rank 0 prints the final weights'
norm after each.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

import pipedream_fast as pdf
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="cnn")
parser.add_argument("--schedule", default="pipedream")
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--chunks", type=int, default=4)
parser.add_argument("--replicate-first", action="store_true")
args = parser.parse_args()



def train(schedule: str) -> None:
    torch.manual_seed(0)
    model, example = build_model(args.model, args.batch_size)
    blocks = len(list(model.children()))
    cut = blocks // 2
    first = (0, 1) if args.replicate_first else (0,)
    plan = Plan(model=args.model, batch_size=args.batch_size, workers=len(first) + 1,
                schedule=schedule,
                stages=[StagePlan(0, cut, len(first), first, 0.0),
                        StagePlan(cut, blocks, 1, (len(first),), 0.0)],
                bottleneck_ms=0.0, data_parallel_ms=0.0)
    pipe = pdf.Pipeline(model, loss_fn=nn.functional.cross_entropy,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
                        plan=plan, schedule=schedule, chunks=args.chunks, timeout=120)
    generator = torch.Generator().manual_seed(1)
    loader = [(torch.randn(args.batch_size, *example.shape[1:], generator=generator),
               torch.randint(0, 10, (args.batch_size,), generator=generator))
              for _ in range(args.steps)]
    for step, loss in enumerate(pipe.train(loader, steps=args.steps)):
        if loss is not None:
            # One write per line: every rank prints the same step at the same moment.
            print(f"{schedule}: rank {pipe.rank} step {step} loss {loss.item():.4f}\n", end="",
                  flush=True)
    state = pipe.state_dict()
    if state is not None:
        norm = torch.sqrt(sum((v.float() ** 2).sum() for v in state.values()))
        print(f"{schedule}: trained {len(state)} tensors, weight norm {norm.item():.6f}",
              flush=True)
    pipe.close()


for name in args.schedule.split(","):
    train(name)
dist.destroy_process_group()
