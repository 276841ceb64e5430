"""`gpt`: a GPT-2-style pre-norm causal decoder — fused qkv projection, F.scaled_dot_product_attention
with is_causal, tanh-GELU MLP, final norm and LM head. Defaults are small (CPU tests);
GptModel(**GPT2_SMALL) is GPT-2 small (12 x 768, 12 heads) at 1024 tokens."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

GPT2_SMALL = dict(vocab=50257, dim=768, depth=12, heads=12, max_len=1024, seq_len=1024)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.c_attn(x).split(D, dim=2)
        q, k, v = (t.view(B, L, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, L, D))


class GptBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc, self.c_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GptModel(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 64, depth: int = 2, heads: int = 2, max_len: int = 128,
                 seq_len: int = 24):
        super().__init__()
        self.vocab, self.seq_len = vocab, seq_len
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(GptBlock(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def example_inputs(self, batch_size: int = 2):
        return (torch.randint(0, self.vocab, (batch_size, self.seq_len), device=self.wte.weight.device),)
