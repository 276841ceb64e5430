"""`mlp`: a tabular regressor of the kind that recommends process parameters (temperatures,
feed rates, pressures) from a vector of sensor features."""
from __future__ import annotations

import torch
from torch import nn


class ProcessMLP(nn.Module):
    def __init__(self, n_features: int = 24, n_targets: int = 4, hidden: int = 256, depth: int = 3,
                 dropout: float = 0.1):
        super().__init__()
        self.n_features = n_features
        layers: list[nn.Module] = [nn.Linear(n_features, hidden), nn.ReLU(), nn.Dropout(dropout)]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.SiLU(), nn.Dropout(dropout)]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(hidden, n_targets)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(features))

    def example_inputs(self, batch_size: int = 64) -> tuple[torch.Tensor]:
        p = next(self.parameters())
        return (torch.randn(batch_size, self.n_features, dtype=p.dtype, device=p.device),)
