"""Built-in models, and the resolver behind `--model NAME_OR_MODULE:FACTORY`.

A model factory takes the batch size and returns `(module, example_input)`, where the
example input is one minibatch. Factories create tensors on the current default device, so
`with torch.device("meta"): cnn(8)` builds a model without allocating memory.

* `cnn`     - "model A": six 3x3 convolutions (64-64-128-128-256-256) on 3x32x32 images, a
              2x2 max-pool after every second one, then Linear 4096-4096-4096-10. An
              nn.Sequential of nine blocks, one per convolution / linear layer.
* `skipnet` - a small residual network whose forward() adds tensors: residual blocks and one
              long skip spanning two blocks, so tracing and multi-cut skip tensors are used.
* `mlp`     - a four-block nn.Sequential MLP on 64 features; tiny, for tests.
* `convnet` - a small CNN for the 1x8x8 `digits` images (`pipedream-fast train`'s default):
              three convolutions, two linear layers, five named blocks.
* `charlm`  - a small character-level transformer language model for the `text` data: an
              embedding block, transformer blocks with causal self-attention, a head; input
              int64 [N, T] character codes, output [N, T, vocab] logits.

`loss_fn` (cross entropy over the last dimension) fits every built-in: class logits [N, C]
against labels [N], and a language model's [N, T, V] against [N, T], both flattened.

User factories (`"package.module:function"`) may take the batch size as their one argument
(or no argument) and return either `(module, example_input)` or a bare `nn.Module`; for a bare
module the caller supplies the input shape (`--input-shape`).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipedream_fast.specs import import_factory

ModelFactory = Callable[[int], "tuple[nn.Module, Any]"]


class ModelSpecError(ValueError):
    """A `--model` value names no built-in model and no importable factory."""


# ---- cnn ("model A") -------------------------------------------------------------------------

def _conv(cin: int, cout: int, pool: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


def build_cnn() -> nn.Sequential:
    """Six convolutions and three linear layers as nine named blocks (3x32x32 -> 10 classes)."""
    widths = [(3, 64), (64, 64), (64, 128), (128, 128), (128, 256), (256, 256)]
    blocks: dict[str, nn.Module] = {
        f"conv{i + 1}": _conv(cin, cout, pool=i % 2 == 1) for i, (cin, cout) in enumerate(widths)}
    blocks["fc1"] = nn.Sequential(nn.Flatten(), nn.Linear(256 * 4 * 4, 4096), nn.ReLU())
    blocks["fc2"] = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU())
    blocks["fc3"] = nn.Linear(4096, 10)
    return nn.Sequential(OrderedDict(blocks))


def cnn(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    return build_cnn(), torch.randn(batch_size, 3, 32, 32)


# ---- skipnet ---------------------------------------------------------------------------------

class ConvBNReLU(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class ResidualBlock(nn.Module):
    """Two convolutions whose output is added to the block's input."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.first = ConvBNReLU(channels, channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(self.first(x))) + x)


class Head(nn.Module):
    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class SkipNet(nn.Module):
    """stem -> res1 -> down -> res2 -> res3 (+ down's output) -> head, on 3x32x32 images.

    The output of `down` is needed again after `res3`, so it crosses the cuts after `down`
    and after `res2`: a skip connection spanning two cuts.
    """

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBNReLU(3, width)
        self.res1 = ResidualBlock(width)
        self.down = ConvBNReLU(width, 2 * width, stride=2)
        self.res2 = ResidualBlock(2 * width)
        self.res3 = ResidualBlock(2 * width)
        self.head = Head(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res1(self.stem(x))
        skip = self.down(x)
        x = self.res3(self.res2(skip)) + skip
        return self.head(x)


def skipnet(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    return SkipNet(), torch.randn(batch_size, 3, 32, 32)


# ---- mlp -------------------------------------------------------------------------------------

def build_mlp(features: int = 64, hidden: int = 128, classes: int = 10) -> nn.Sequential:
    return nn.Sequential(OrderedDict(
        fc1=nn.Sequential(nn.Linear(features, hidden), nn.ReLU()),
        fc2=nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        fc3=nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        fc4=nn.Linear(hidden, classes)))


def mlp(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    return build_mlp(), torch.randn(batch_size, 64)


# ---- convnet (digits) ------------------------------------------------------------------------

def build_convnet(classes: int = 10, dropout: float = 0.25) -> nn.Sequential:
    """1x8x8 images -> `classes` logits, as five named blocks (conv1..conv3, fc1, fc2)."""
    return nn.Sequential(OrderedDict(
        conv1=nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU()),
        conv2=nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        conv3=nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        fc1=nn.Sequential(nn.Flatten(), nn.Linear(64 * 2 * 2, 128), nn.ReLU(),
                          nn.Dropout(dropout)),
        fc2=nn.Linear(128, classes)))


def convnet(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    return build_convnet(), torch.randn(batch_size, 1, 8, 8)


# ---- charlm (text) ---------------------------------------------------------------------------

CHARLM_SEQ_LEN = 64  # characters per sample of the `text` data and positions of the model


class CharEmbedding(nn.Module):
    """Character codes [N, T] -> token plus learned position embeddings [N, T, D]."""

    def __init__(self, vocab_size: int, dim: int, max_len: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(codes.shape[1], device=codes.device)
        return self.dropout(self.tokens(codes) + self.positions(positions))


class CausalBlock(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads = heads
        self.dropout = dropout
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = (part.reshape(n, t, self.heads, d // self.heads).transpose(1, 2)
                   for part in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        attended = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(attended.transpose(1, 2).reshape(n, t, d))
        return x + self.mlp(self.norm2(x))


def build_charlm(vocab_size: int | None = None, dim: int = 64, layers: int = 2, heads: int = 4,
                 max_len: int = CHARLM_SEQ_LEN, dropout: float = 0.1) -> nn.Sequential:
    """Blocks embed, block1..blockL, head; [N, T] codes -> [N, T, vocab_size] logits
    (default vocabulary: the `text` data's)."""
    if vocab_size is None:
        from pipedream_fast.datasets import VOCAB_SIZE
        vocab_size = VOCAB_SIZE
    blocks: dict[str, nn.Module] = {"embed": CharEmbedding(vocab_size, dim, max_len, dropout)}
    for i in range(layers):
        blocks[f"block{i + 1}"] = CausalBlock(dim, heads, dropout)
    blocks["head"] = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab_size))
    return nn.Sequential(OrderedDict(blocks))


def charlm(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    from pipedream_fast.datasets import VOCAB_SIZE
    return build_charlm(VOCAB_SIZE), torch.randint(0, VOCAB_SIZE, (batch_size, CHARLM_SEQ_LEN))


def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the last dimension: [N, C] vs [N], or [N, T, V] vs [N, T]."""
    return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]),
                                       targets.reshape(-1))


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Share of correct argmax predictions (per sample, or per position of a sequence)."""
    return (outputs.argmax(-1) == targets).float().mean()


BUILTIN_MODELS: dict[str, ModelFactory] = {"cnn": cnn, "skipnet": skipnet, "mlp": mlp,
                                           "convnet": convnet, "charlm": charlm}


# ---- resolving --model -----------------------------------------------------------------------

def resolve_model(spec: str) -> Callable[[int], tuple[nn.Module, Any | None]]:
    """A factory for `spec`: a built-in name or `"package.module:factory"`.

    The returned callable takes the batch size and gives `(module, example_input)`, with
    `example_input` None when a user factory returned a bare module.
    """
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec]
    if ":" not in spec:
        raise ModelSpecError(f"unknown model {spec!r}: built-in models are "
                             f"{', '.join(sorted(BUILTIN_MODELS))}; for your own model give "
                             f"MODULE:FACTORY, e.g. 'mypkg.models:build'")
    factory = import_factory(spec, "model", ModelSpecError, "mypkg.models:build")
    return lambda batch_size: _call_factory(factory, spec, batch_size)


def _takes_an_argument(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
               for p in params)


def _call_factory(factory: Callable[..., Any], spec: str,
                  batch_size: int) -> tuple[nn.Module, Any | None]:
    result = factory(batch_size) if _takes_an_argument(factory) else factory()
    if isinstance(result, nn.Module):
        return result, None
    if (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        return result[0], result[1]
    raise ModelSpecError(f"factory {spec!r} returned {type(result).__name__}; it must return an "
                         f"nn.Module or a (module, example_input) tuple")


def build_model(spec: str, batch_size: int,
                input_shape: tuple[int, ...] | None = None) -> tuple[nn.Module, Any]:
    """Module and example minibatch for `spec`; `input_shape` (per sample) overrides the input."""
    if batch_size <= 0:
        raise ModelSpecError(f"batch size must be positive, got {batch_size}")
    module, example = resolve_model(spec)(batch_size)
    if input_shape is not None:
        example = torch.randn(batch_size, *input_shape)
    if example is None:
        raise ModelSpecError(f"factory {spec!r} returned a module without an example input; "
                             f"give the per-sample input shape, e.g. --input-shape 3,224,224")
    return module, example
