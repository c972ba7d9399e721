"""A small CNN with dropout on scikit-learn's handwritten digits, on a pipeline.

    pipedream-fast run --nproc 2 examples/cnn_pipeline.py --epochs 5
    torchrun --standalone --nproc-per-node 2 examples/cnn_pipeline.py --epochs 5

What changed from examples/cnn_plain.py (`diff examples/cnn_plain.py examples/cnn_pipeline.py`):
the import of pipedream_fast; the optimizer becomes a factory handed to pdf.Pipeline, which
plans the split on the first minibatch; the training loop becomes
`for loss in pipe.train(loader, epochs=...)`; the evaluation loop becomes `pipe.evaluate(...)`;
and only rank 0 prints (plus a --stages option). The model, data, loader and loss are
untouched.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

import pipedream_fast as pdf
from pipedream_fast.datasets import digits

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--steps", type=int, default=None, help="train this many steps instead")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--log-every", type=int, default=20)
parser.add_argument("--stages", type=int, default=None, help="default: the planner chooses")
args = parser.parse_args()

torch.manual_seed(0)  # the same initial weights on every run (and on every rank)
train_set, test_set = digits()  # float32 [1, 8, 8] images, int64 labels 0-9
loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
test_loader = DataLoader(test_set, batch_size=args.batch_size)
model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
    nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
    nn.Flatten(), nn.Dropout(0.25),
    nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
    nn.Linear(64, 10),
)
loss_fn = nn.functional.cross_entropy


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(-1) == targets).float().mean()


pipe = pdf.Pipeline(model, loss_fn,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                    schedule="1f1b", chunks=4, stages=args.stages)
length = {"epochs": args.epochs} if args.steps is None else {"steps": args.steps}
for step, loss in enumerate(pipe.train(loader, **length), 1):
    if pipe.rank == 0 and (step % args.log_every == 0 or step == args.steps):
        print(f"step {step} loss {loss.item():.4f}", flush=True)
if pipe.rank == 0:  # planned on the first minibatch
    print("plan: " + ", ".join(f"blocks {s.start}-{s.stop - 1} on ranks {list(s.ranks)}"
                               for s in pipe.plan.stages), flush=True)

results = pipe.evaluate(test_loader, metrics={"accuracy": accuracy})
if pipe.rank == 0:
    print(f"test loss {results['loss']:.4f} accuracy {results['accuracy']:.4f}")
pipe.close()
