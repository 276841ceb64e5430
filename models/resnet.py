"""`resnet`: a ResNet (He et al. 2016) with both block types — BasicBlock (ResNet-18/34) and
Bottleneck (ResNet-50/101) — conv + BatchNorm + ReLU, residual adds, a 7x7 stride-2 stem, max
pool, global average pool. Defaults are small (CPU tests); ResNet(**RESNET50) is ResNet-50."""
from __future__ import annotations

import torch
from torch import nn

RESNET50 = dict(block="bottleneck", layers=(3, 4, 6, 3), width=64, image_size=224)


def _conv_bn(cin, cout, k, stride=1):
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, width, stride=1):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, width, 3, stride)
        self.conv2, self.bn2 = _conv_bn(width, width, 3)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(*_conv_bn(cin, width, 1, stride))
                           if stride != 1 or cin != width else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, width, stride=1):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv_bn(cin, width, 1)
        self.conv2, self.bn2 = _conv_bn(width, width, 3, stride)
        self.conv3, self.bn3 = _conv_bn(width, cout, 1)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (nn.Sequential(*_conv_bn(cin, cout, 1, stride))
                           if stride != 1 or cin != cout else None)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, block: str = "bottleneck", layers=(1, 1, 1, 1), width: int = 16, image_size: int = 32,
                 classes: int = 10):
        super().__init__()
        Block = {"basic": BasicBlock, "bottleneck": Bottleneck}[block]
        self.image_size = image_size
        self.conv1, self.bn1 = _conv_bn(3, width, 7, stride=2)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        stages, cin = [], width
        for i, n in enumerate(layers):
            w = width * 2 ** i
            blocks = []
            for j in range(n):
                blocks.append(Block(cin, w, stride=2 if (j == 0 and i > 0) else 1))
                cin = w * Block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():  # non-trivial BN statistics, so that folding them is tested
            if isinstance(m, nn.BatchNorm2d):
                nn.init.uniform_(m.weight, 0.5, 1.5)
                nn.init.uniform_(m.bias, -0.2, 0.2)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def example_inputs(self, batch_size: int = 2):
        p = next(self.parameters())
        return (torch.randn(batch_size, 3, self.image_size, self.image_size, dtype=p.dtype, device=p.device),)
