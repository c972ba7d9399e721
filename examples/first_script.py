"""A first pipeline: a small network learns scikit-learn's handwritten digits on 2 ranks.

    pipedream-fast run --nproc 2 examples/first_script.py      # 2 processes
    python examples/first_script.py --threads 2                # 2 threads of one process

A rank is one worker: a process, or a thread with --threads. The model is cut in two stages,
one per rank. Rank 0 runs the first layers, rank 1 the rest. Each minibatch of 32 images is
split into 4 microbatches that flow through the two stages one after the other.

Every rank runs this whole file. So the script prints only on rank 0, or every line would
appear once per rank. Copy this file to start your own script: change the model, the data and
the optimizer, keep the rest.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

import pipedream_fast as pdf
from pipedream_fast.datasets import digits


def build_model() -> nn.Module:
    """A plain PyTorch model. pdf.Pipeline cuts it between its layers."""
    return nn.Sequential(
        nn.Flatten(),             # [batch, 1, 8, 8] images -> [batch, 64]
        nn.Linear(64, 128), nn.ReLU(),
        nn.Linear(128, 64), nn.ReLU(),
        nn.Linear(64, 10),        # one score per digit 0-9
    )


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="run N ranks as threads of this process (default: one rank per "
                             "process, started by pipedream-fast run)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="train this many steps instead")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--schedule", default="1f1b", help="1f1b, gpipe, pipedream, 2bw, ...")
    parser.add_argument("--chunks", type=int, default=4, help="microbatches per minibatch")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--save", default=None, metavar="FILE",
                        help="write the trained model's state_dict() here (torch.save)")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial weights on every run
    train_set, test_set = digits()  # float32 [1, 8, 8] images, int64 labels 0-9
    # A short last batch is fine: its microbatches are weighted by their samples.
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size)

    # Where the ranks live: processes (the default) or threads of this one process.
    ranks = {"ranks": "threads", "workers": args.threads} if args.threads else {}
    pipe = pdf.Pipeline(
        build_model(), loss_fn=nn.functional.cross_entropy,
        # A factory, not an optimizer: each stage makes its own for its own parameters.
        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
        # stages=2: two stages, one per rank, so exactly 2 ranks. Leave it out and the planner
        # chooses the stages (and replicas of them) for any number of ranks.
        schedule=args.schedule, chunks=args.chunks, stages=2, **ranks)

    # pipe.train() yields each step's loss, the same on every rank. The first step also makes
    # the plan: how the model is cut into stages (rank 0 prints it in one line).
    length = {"epochs": args.epochs} if args.steps is None else {"steps": args.steps}
    for step, loss in enumerate(pipe.train(loader, **length), 1):
        if pipe.rank == 0 and (step % args.log_every == 0 or step == args.steps):
            # .item(): a plain Python number; printing the tensor would show tensor(...).
            print(f"step {step} loss {loss.item():.6f}", flush=True)

    if pipe.rank == 0:  # pipe.plan: the stages, their blocks and their ranks
        for index, stage in enumerate(pipe.plan.stages):
            print(f"stage {index}: blocks {stage.start}-{stage.stop - 1} "
                  f"on rank {', '.join(map(str, stage.ranks))}", flush=True)

    # Every rank calls evaluate() and state_dict(): the ranks work on them together.
    results = pipe.evaluate(test_loader, metrics={"accuracy": accuracy})
    weights = pipe.state_dict()  # the whole model on rank 0, None on the other ranks
    if pipe.rank == 0:
        print(f"test loss {results['loss']:.4f} accuracy {results['accuracy']:.4f}", flush=True)
        if args.save:
            torch.save(weights, args.save)  # loads into build_model() with load_state_dict
    pipe.close()  # stops the communication threads and leaves the process group


if __name__ == "__main__":
    main()
