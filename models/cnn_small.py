"""`cnn_small`: a small CNN few-class classifier (e.g. defect / no-defect from 64x64 camera crops):
three conv stages with BatchNorm and ReLU, max pooling, global average pooling, a linear head."""
from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 3, width: int = 16, image_size: int = 32):
        super().__init__()
        self.image_size = image_size
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding="same"), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1), nn.SiLU(),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.features(x)), 1))

    def example_inputs(self, batch_size: int = 4):
        p = next(self.parameters())
        return (torch.randn(batch_size, 3, self.image_size, self.image_size, dtype=p.dtype, device=p.device),)
