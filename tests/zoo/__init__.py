"""The model zoo: public model code, unedited, at tiny sizes, built from configs (no weights
are downloaded). Each entry builds a seeded model and its minibatches as a user's loop would
feed them: nanoGPT-style and Hugging Face models compute their own loss from inputs that
include the targets (`loss_fn=None`); torchvision and timm models take `(images, labels)`."""

from __future__ import annotations

import functools
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


def nanogpt(drop: float = 0.0) -> nn.Module:
    from zoo.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32,
                         dropout=drop))


def llama(drop: float = 0.0) -> nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                                      tie_word_embeddings=True, attention_dropout=drop)
    return transformers.LlamaForCausalLM(config)


def gpt2(drop: float = 0.0) -> nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=32,
                                     n_layer=2, n_head=4, resid_pdrop=drop, embd_pdrop=drop,
                                     attn_pdrop=drop, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def bert(drop: float = 0.0) -> nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=2 * SEQ, num_labels=3,
                                     hidden_dropout_prob=drop, attention_probs_dropout_prob=drop)
    return transformers.BertForSequenceClassification(config)


def resnet18() -> nn.Module:
    torchvision = import_torchvision()
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def vit_tiny(drop: float = 0.0) -> nn.Module:
    import_torchvision()  # timm imports it
    import timm
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                             patch_size=8, depth=2, num_classes=10, drop_rate=drop,
                             attn_drop_rate=drop, drop_path_rate=drop)


def swin_tiny() -> nn.Module:
    """torchvision's Swin Transformer at a tiny size, with swin_t's stochastic depth (0.2)."""
    import_torchvision()
    from torchvision.models.swin_transformer import SwinTransformer
    torch.manual_seed(0)
    return SwinTransformer(patch_size=[4, 4], embed_dim=24, depths=[2, 2], num_heads=[2, 4],
                           window_size=[4, 4], stochastic_depth_prob=0.2, num_classes=10)


def efficientnet_b0() -> nn.Module:
    """torchvision's EfficientNet-B0 with its defaults: stochastic depth 0.2, dropout 0.2."""
    torchvision = import_torchvision()
    torch.manual_seed(0)
    return torchvision.models.efficientnet_b0(num_classes=10)


def _images64(steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """64x64 images: at 32x32 EfficientNet's last stages see 1x1 maps, whose batch norm over
    a 4-sample microbatch makes the plain model's own eval outputs NaN."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 3, 64, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(steps)]


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

# The models with their real drop rates (dropout, attention dropout, stochastic depth, drop
# path), for checking that evaluation and prediction run them as model.eval() would: the
# zoo above keeps them at 0 so that training can be compared with the plain loop exactly.
DROPPING = {m.name: m for m in [
    ZooModel("nanogpt+dropout", functools.partial(nanogpt, 0.1), _lm_pairs, None, tied=True),
    ZooModel("llama+dropout", functools.partial(llama, 0.1), _lm_dicts, None, tied=True),
    ZooModel("gpt2+dropout", functools.partial(gpt2, 0.1), _lm_dicts, None, tied=True),
    ZooModel("bert+dropout", functools.partial(bert, 0.1), _classify, None, tied=False),
    ZooModel("vit_tiny+drop_path", functools.partial(vit_tiny, 0.1), _images, cross_entropy,
             tied=False),
    ZooModel("swin_tiny", swin_tiny, _images, cross_entropy, tied=False),
    ZooModel("efficientnet_b0", efficientnet_b0, _images64, cross_entropy, tied=False),
]}


import_torchvision()  # before transformers or timm import it


def call(model: nn.Module, inputs: Any) -> Any:
    """The model on one microbatch's inputs, as a user's loop calls it."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| over one tensor (in float64)."""
    a, b = a.detach().double(), b.detach().double()
    return float(torch.linalg.vector_norm(a - b)) / max(float(torch.linalg.vector_norm(b)),
                                                        1e-12)


def one_torch_thread() -> Any:
    """A fixture body: one torch thread for the test, as each rank has."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
