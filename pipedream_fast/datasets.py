"""Built-in datasets for `pipedream-fast train --data NAME`, and the resolver behind `--data`.

Both built-ins are real data that ship with something already installed, so nothing is
downloaded:

* `digits` - scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), as float32
  [N, 1, 8, 8] scaled to [0, 1] and normalised with the training split's mean and standard
  deviation; a fixed stratified 80/20 split (seed 0).
* `text`   - a character-level language-modelling corpus: the docstrings of this package's
  own source files, gathered with `ast` from the installed package. Each sample is a window
  of `seq_len` characters `x` and the same window shifted by one character `y`; the first
  90% of the corpus trains, the last 10% tests. The vocabulary is fixed (newline, printable
  ASCII, one code for anything else), so models can be built without reading the corpus.

`--data package.module:factory` names your own: a callable (no arguments) returning
`(train_dataset, test_dataset)`, each yielding `(input, target)` samples.
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

from pipedream_fast.specs import import_factory

BUILTIN_DATA = ("digits", "text")

# Character vocabulary of the `text` corpus: newline, the 95 printable ASCII characters, and
# one last code for every other character.
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCAB) + 1
_UNKNOWN = len(VOCAB)
_CODES = {ch: i for i, ch in enumerate(VOCAB)}


class DataSpecError(ValueError):
    """A `--data` value names no built-in dataset and no importable factory."""


# ---- digits ----------------------------------------------------------------------------------

def digits() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's digits: train and test TensorDatasets of (float32 [1, 8, 8], int64)."""
    try:  # imported by name: scikit-learn ships no type information
        sk_datasets = importlib.import_module("sklearn.datasets")
        sk_selection = importlib.import_module("sklearn.model_selection")
    except ImportError as err:  # pragma: no cover - scikit-learn is an install requirement
        raise DataSpecError("the digits dataset comes with scikit-learn: "
                            "pip install scikit-learn") from err
    bunch = sk_datasets.load_digits()
    x_train, x_test, y_train, y_test = sk_selection.train_test_split(
        bunch.data, bunch.target, test_size=0.2, random_state=0, stratify=bunch.target)

    def images(x: Any) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0

    train_x, test_x = images(x_train), images(x_test)
    mean, std = train_x.mean(), train_x.std()
    return (TensorDataset((train_x - mean) / std, torch.as_tensor(y_train, dtype=torch.int64)),
            TensorDataset((test_x - mean) / std, torch.as_tensor(y_test, dtype=torch.int64)))


# ---- text ------------------------------------------------------------------------------------

def package_docstrings(root: str | os.PathLike[str] | None = None) -> str:
    """The docstrings of every module, class and function under `root` (default: the
    installed pipedream_fast package), in file order, separated by blank lines."""
    folder = Path(root) if root is not None else Path(__file__).resolve().parent
    docs: list[str] = []
    for path in sorted(folder.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
    return "\n\n".join(docs)


def encode(text: str) -> torch.Tensor:
    """Character codes of `text` in the fixed vocabulary (int64)."""
    return torch.tensor([_CODES.get(ch, _UNKNOWN) for ch in text], dtype=torch.int64)


def decode(codes: Any) -> str:
    return "".join(VOCAB[int(c)] if int(c) < len(VOCAB) else "?" for c in codes)


class CharWindows(Dataset):
    """Non-overlapping windows of a code sequence: sample i is (codes[s : s + T],
    codes[s + 1 : s + T + 1]) with s = i * T."""

    def __init__(self, codes: torch.Tensor, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.codes = codes
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.codes) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.seq_len
        window = self.codes[start:start + self.seq_len + 1]
        return window[:-1], window[1:]


@functools.lru_cache(maxsize=1)
def _corpus_codes() -> torch.Tensor:
    return encode(package_docstrings())


def char_corpus(seq_len: int = 64) -> tuple[Dataset, Dataset, int]:
    """The package's docstrings as character-level LM data: train and test datasets of
    (x int64 [seq_len], y int64 [seq_len] = x shifted by one character), split 90/10 by
    position, and the vocabulary size."""
    codes = _corpus_codes()
    cut = int(len(codes) * 0.9)
    return CharWindows(codes[:cut], seq_len), CharWindows(codes[cut:], seq_len), VOCAB_SIZE


# ---- resolving --data ------------------------------------------------------------------------

def _text() -> tuple[Dataset, Dataset]:
    train, test, _ = char_corpus()
    return train, test


_BUILTINS: dict[str, Callable[[], tuple[Any, Any]]] = {"digits": digits, "text": _text}


def resolve_data(spec: str) -> tuple[Any, Any]:
    """(train, test) datasets for `--data`: a built-in name or "package.module:factory"."""
    if spec in _BUILTINS:
        return _BUILTINS[spec]()
    if ":" not in spec:
        raise DataSpecError(f"unknown dataset {spec!r}: built-in datasets are "
                            f"{', '.join(BUILTIN_DATA)}; for your own data give MODULE:FACTORY "
                            f"returning (train_dataset, test_dataset), e.g. 'mypkg.data:load'")
    factory = import_factory(spec, "dataset", DataSpecError, "mypkg.data:load")
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise DataSpecError(f"data factory {spec!r} returned {type(result).__name__}; it must "
                            f"return a (train_dataset, test_dataset) tuple")
    for name, part in zip(("train", "test"), result):
        if not hasattr(part, "__len__") or not hasattr(part, "__getitem__"):
            raise DataSpecError(f"the {name} dataset of {spec!r} is a {type(part).__name__}, "
                                f"not a map-style dataset (with __len__ and __getitem__)")
        if len(part) == 0:
            raise DataSpecError(f"the {name} dataset of {spec!r} is empty")
    return result
