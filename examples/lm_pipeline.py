"""A character-level transformer language model on this package's docstrings, on a pipeline.

    pipedream-fast run --nproc 2 examples/lm_pipeline.py --epochs 2
    torchrun --standalone --nproc-per-node 2 examples/lm_pipeline.py --epochs 2

What changed from examples/lm_plain.py (`diff examples/lm_plain.py examples/lm_pipeline.py`):
the import of pipedream_fast; the optimizer becomes a factory handed to pdf.Pipeline, which
plans the split on the first minibatch; the training loop becomes
`for loss in pipe.train(loader, epochs=...)`; the evaluation loop becomes `pipe.evaluate(...)`;
and only rank 0 prints (plus a --stages option). The model, data, loader and loss are
untouched.
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader

import pipedream_fast as pdf
from pipedream_fast.datasets import char_corpus

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--steps", type=int, default=None, help="train this many steps instead")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--seq-len", type=int, default=64)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--log-every", type=int, default=20)
parser.add_argument("--stages", type=int, default=None, help="default: the planner chooses")
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

pipe = pdf.Pipeline(model, loss_fn, optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
                    schedule="1f1b", chunks=4, stages=args.stages)
length = {"epochs": args.epochs} if args.steps is None else {"steps": args.steps}
for step, loss in enumerate(pipe.train(loader, **length), 1):
    if pipe.rank == 0 and (step % args.log_every == 0 or step == args.steps):
        print(f"step {step} loss {loss.item():.4f}", flush=True)
if pipe.rank == 0:  # planned on the first minibatch
    print("plan: " + ", ".join(f"blocks {s.start}-{s.stop - 1} on ranks {list(s.ranks)}"
                               for s in pipe.plan.stages), flush=True)

results = pipe.evaluate(test_loader)
if pipe.rank == 0:
    print(f"test loss {results['loss']:.4f} ({results['loss'] / math.log(2):.3f} bits per "
          f"character)")
pipe.close()
