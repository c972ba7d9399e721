"""A character-level transformer language model on this package's docstrings, in one process.

    python examples/lm_plain.py --epochs 2

examples/lm_pipeline.py is this script on a pipeline: `diff` the two to see what changes.
The model is an nn.Sequential of blocks (embedding, transformer layers, head): the blocks a
pipeline may place on different stages.
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader

from pipedream_fast.datasets import char_corpus

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--steps", type=int, default=None, help="train this many steps instead")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--log-every", type=int, default=20)
args = parser.parse_args()


class Embedding(nn.Module):
    """Token and learned position embeddings."""

    def __init__(self, vocab: int, dim: int, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.randn(seq_len, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tokens(x) + self.positions[: x.shape[1]]


class Layer(nn.Module):
    """A pre-norm transformer layer: causal self-attention, then an MLP, each residual."""

    def __init__(self, dim: int, heads: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.out = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


torch.manual_seed(0)  # the same initial weights on every run (and on every rank)
train_set, test_set, vocab = char_corpus(seq_len=args.seq_len)  # (x, y = x shifted by one)
loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
test_loader = DataLoader(test_set, batch_size=args.batch_size, drop_last=True)
model = nn.Sequential(Embedding(vocab, args.dim, args.seq_len),
                      *[Layer(args.dim) for _ in range(args.layers)],
                      Head(args.dim, vocab))

optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
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
total = 0.0
with torch.no_grad():
    for inputs, targets in test_loader:
        total += loss_fn(model(inputs), targets).item() * len(targets)
results = {"loss": total / (len(test_loader) * args.batch_size)}
print(f"test loss {results['loss']:.4f} ({results['loss'] / math.log(2):.3f} bits per character)")
