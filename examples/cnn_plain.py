"""A small CNN with dropout on scikit-learn's handwritten digits, in one process.

    python examples/cnn_plain.py --epochs 5

examples/cnn_pipeline.py is this script on a pipeline: `diff` the two to see what changes.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader

from pipedream_fast.datasets import digits

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--steps", type=int, default=None, help="train this many steps instead")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--log-every", type=int, default=20)
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


optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
epochs = args.epochs if args.steps is None else -(-args.steps // len(loader))
step = 0
model.train()
for _ in range(epochs):
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.log_every == 0 or step == args.steps:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if step == args.steps:
            break

model.eval()
totals = {"loss": 0.0, "accuracy": 0.0}
with torch.no_grad():
    for inputs, targets in test_loader:
        outputs = model(inputs)
        totals["loss"] += loss_fn(outputs, targets).item() * len(targets)
        totals["accuracy"] += accuracy(outputs, targets).item() * len(targets)
results = {name: total / len(test_set) for name, total in totals.items()}
print(f"test loss {results['loss']:.4f} accuracy {results['accuracy']:.4f}")
