"""Helpers for real architectures built with random weights (HF transformers, timm)."""
from __future__ import annotations

import torch


def reinit(model: torch.nn.Module) -> torch.nn.Module:
    """Weights at a scale that keeps fp16 activations alive through a deep net (HF's 0.02 init
    makes a deep CNN's activations underflow to zeros, and zeros check nothing), and batch norms
    with non-trivial statistics, so that folding them is checked. In eval mode."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
                m.weight.normal_(0, (1.0 / m.weight[0].numel()) ** 0.5)
                if m.bias is not None:
                    m.bias.normal_(0, 0.1)
            elif isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.0)
                m.bias.normal_(0, 0.1)
    return model.eval()
