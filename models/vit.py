"""`vit`: a Vision Transformer — patch embedding by a strided conv, class token, pre-norm encoder
blocks with nn.MultiheadAttention (as torchvision's ViT), GELU MLP. Defaults are small (CPU tests);
VitModel(**VIT_B16) is ViT-B/16 at 224x224 (197 tokens, 12 heads of 64)."""
from __future__ import annotations

import torch
from torch import nn

VIT_B16 = dict(image_size=224, patch=16, dim=768, depth=12, heads=12, mlp=3072)


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class VitModel(nn.Module):
    def __init__(self, image_size: int = 32, patch: int = 8, dim: int = 64, depth: int = 2, heads: int = 2,
                 mlp: int = 128, classes: int = 10):
        super().__init__()
        self.image_size = image_size
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        n = (image_size // patch) ** 2
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(dim, heads, mlp) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)         # (B, patches, dim)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])

    def example_inputs(self, batch_size: int = 2):
        p = next(self.parameters())
        return (torch.randn(batch_size, 3, self.image_size, self.image_size, dtype=p.dtype, device=p.device),)
