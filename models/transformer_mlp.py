"""`transformer_mlp`: a stack of pre-norm transformer MLP blocks, x + fc2(gelu(fc1(norm(x)))),
as in every transformer's feed-forward half. Defaults are small (CPU tests); dim=1024,
hidden=4096, seq_len=512 is a realistic size."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, approximate: str = "none"):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)), approximate=self.approximate))


class TransformerMLP(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256, depth: int = 4, seq_len: int = 16,
                 approximate: str = "none"):
        super().__init__()
        self.dim, self.seq_len = dim, seq_len
        self.blocks = nn.ModuleList(MLPBlock(dim, hidden, approximate) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def example_inputs(self, batch_size: int = 4) -> tuple[torch.Tensor]:
        p = next(self.parameters())
        return (torch.randn(batch_size, self.seq_len, self.dim, dtype=p.dtype, device=p.device),)
