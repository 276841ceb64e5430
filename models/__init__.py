"""Built-in example models, by name: accelc.models.get("mlp"), the CLI's `accelc optimize mlp`.

Each model is built in eval mode with weights drawn from a fixed seed (the caller's RNG state is
left alone) and has `example_inputs(batch_size=None)` giving inputs of its default shape.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from accelc.models.bert import BERT_BASE, BertModel
from accelc.models.cnn_small import SmallCNN
from accelc.models.gpt import GPT2_SMALL, GptModel
from accelc.models.mlp import ProcessMLP
from accelc.models.resnet import RESNET50, ResNet
from accelc.models.transformer_mlp import TransformerMLP
from accelc.models.vit import VIT_B16, VitModel

# name -> (builder, one-line description)
_MODELS: dict[str, tuple[Callable[..., nn.Module], str]] = {
    "mlp": (ProcessMLP, "tabular regressor: sensor features -> process parameters (Linear+ReLU/SiLU)"),
    "transformer_mlp": (TransformerMLP, "stack of pre-norm MLP blocks (LayerNorm, Linear+GELU, residual)"),
    "vit": (VitModel, "Vision Transformer: conv patch embedding, nn.MultiheadAttention encoder"),
    "bert": (BertModel, "BERT-style post-norm encoder, written-out attention with key-padding mask"),
    "gpt": (GptModel, "GPT-2-style pre-norm causal decoder, scaled_dot_product_attention"),
    "resnet": (ResNet, "ResNet with Bottleneck (or BasicBlock) blocks: conv + BN + ReLU, residual adds"),
    "cnn_small": (SmallCNN, "small CNN few-class classifier: conv + BN + ReLU stages, pooling, linear head"),
}

# realistic sizes: accelc.models.get("bert", **accelc.models.SIZES["bert"])
SIZES = {"vit": VIT_B16, "bert": BERT_BASE, "gpt": GPT2_SMALL, "resnet": RESNET50}


def names() -> list[str]:
    return sorted(_MODELS)


def describe(name: str) -> str:
    return _lookup(name)[1]


def get(name: str, seed: int = 0, **kwargs) -> nn.Module:
    """Build model `name` (kwargs go to its constructor, e.g. sizes) in eval mode."""
    builder = _lookup(name)[0]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = builder(**kwargs)
    return model.eval()


def _lookup(name: str):
    if name not in _MODELS:
        raise KeyError(f"no built-in model {name!r}; built-in models: {', '.join(names())}")
    return _MODELS[name]


__all__ = ["SIZES", "describe", "get", "names"]
