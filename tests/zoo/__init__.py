"""The model zoo: public model code, unedited, at tiny sizes, built from configs (no weights
are downloaded). Each entry builds a seeded model and its minibatches as a user's loop would
feed them: nanoGPT-style and Hugging Face models compute their own loss from inputs that
include the targets (`loss_fn=None`); torchvision and timm models take `(images, labels)`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB, SEQ, BATCH = 64, 16, 8


def import_torchvision() -> Any:
    """torchvision's models are plain Python, but its compiled operators (nms, ...) on PyPI
    link a CUDA torch: beside a CPU torch they fail to load, and importing torchvision then
    fails on registering fake kernels for operators that do not exist. Where they cannot
    load, declare those two (never called by the zoo) before the import."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        raise ImportError("torchvision is not installed: pip install -e '.[zoo]'")
    if not _KEEP and "torchvision" not in __import__("sys").modules:
        library = os.path.join(os.path.dirname(spec.origin), "_C.so")
        try:
            torch.ops.load_library(library)
        except (OSError, RuntimeError):
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _KEEP.append(lib)  # the definitions live as long as the library object
    import torchvision
    return torchvision


_KEEP: list[Any] = []


@dataclass
class ZooModel:
    name: str
    build: Callable[[], nn.Module]
    batches: Callable[[int, int], list[Any]]  # (steps, seed) -> loader items
    loss_fn: Callable[[Any, Any], torch.Tensor] | None  # None: the model computes its loss
    tied: bool  # a weight shared by the embedding and the head


def _tokens(steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(steps)]


def _images(steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 3, 32, 32, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(steps)]


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def nanogpt() -> nn.Module:
    from zoo.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32))


def llama() -> nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def gpt2() -> nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32,
                                     n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def bert() -> nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=2 * SEQ, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


def resnet18() -> nn.Module:
    torchvision = import_torchvision()
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def vit_tiny() -> nn.Module:
    import_torchvision()  # timm imports it
    import timm
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                             patch_size=8, depth=2, num_classes=10)


def _lm_pairs(steps: int, seed: int) -> list[Any]:
    return [(x, x.roll(-1, 1)) for x in _tokens(steps, seed)]  # nanoGPT: model(idx, targets)


def _lm_dicts(steps: int, seed: int) -> list[Any]:
    return [{"input_ids": x, "labels": x} for x in _tokens(steps, seed)]  # HF shifts labels


def _classify(steps: int, seed: int) -> list[Any]:
    g = torch.Generator().manual_seed(seed + 100)
    items = []
    for x in _tokens(steps, seed):
        mask = torch.ones_like(x)
        mask[: BATCH // 2, SEQ // 2:] = 0  # padded sequences: the mask matters
        items.append({"input_ids": x, "attention_mask": mask,
                      "labels": torch.randint(0, 3, (BATCH,), generator=g)})
    return items


ZOO = {m.name: m for m in [
    ZooModel("nanogpt", nanogpt, _lm_pairs, None, tied=True),
    ZooModel("llama", llama, _lm_dicts, None, tied=True),
    ZooModel("gpt2", gpt2, _lm_dicts, None, tied=True),
    ZooModel("bert", bert, _classify, None, tied=False),
    ZooModel("resnet18", resnet18, _images, cross_entropy, tied=False),
    ZooModel("vit_tiny", vit_tiny, _images, cross_entropy, tied=False),
]}


import_torchvision()  # before transformers or timm import it


def call(model: nn.Module, inputs: Any) -> Any:
    """The model on one microbatch's inputs, as a user's loop calls it."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)
