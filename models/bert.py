"""`bert`: a BERT-style post-norm encoder — token + position embeddings, self-attention written out
as BERT implementations write it (scores / sqrt(d) + key-padding mask, softmax, dropout, @ v),
GELU MLP. Defaults are small (CPU tests); BertModel(**BERT_BASE) is BERT-base (12 x 768, 12 heads)."""
from __future__ import annotations

import math

import torch
from torch import nn

BERT_BASE = dict(vocab=30522, dim=768, depth=12, heads=12, mlp=3072, max_len=512, seq_len=384)


class BertSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.1):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def split(self, x):  # (B, L, dim) -> (B, heads, L, head_dim)
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x, mask):
        q, k, v = self.split(self.query(x)), self.split(self.key(x)), self.split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2))
        scores = scores / math.sqrt(self.head_dim)
        scores = scores + mask
        probs = self.dropout(nn.functional.softmax(scores, dim=-1))
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).contiguous()
        return ctx.view(ctx.shape[0], ctx.shape[1], -1)


class BertLayer(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int):
        super().__init__()
        self.attention = BertSelfAttention(dim, heads)
        self.attn_out = nn.Linear(dim, dim)
        self.ln1 = nn.LayerNorm(dim, eps=1e-12)
        self.intermediate = nn.Linear(dim, mlp)
        self.output = nn.Linear(mlp, dim)
        self.ln2 = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x, mask):
        x = self.ln1(x + self.attn_out(self.attention(x, mask)))
        return self.ln2(x + self.output(nn.functional.gelu(self.intermediate(x))))


class BertModel(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 64, depth: int = 2, heads: int = 2, mlp: int = 128,
                 max_len: int = 128, seq_len: int = 24):
        super().__init__()
        self.vocab, self.seq_len = vocab, seq_len
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)
        self.ln = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(dim, heads, mlp) for _ in range(depth))

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.ln(self.tokens(input_ids) + self.positions(pos))
        # (B, L) 1 = token, 0 = padding  ->  additive (B, 1, 1, L) in the model's dtype
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def example_inputs(self, batch_size: int = 2):
        device = self.tokens.weight.device
        ids = torch.randint(0, self.vocab, (batch_size, self.seq_len), device=device)
        mask = torch.ones(batch_size, self.seq_len, dtype=torch.long, device=device)
        for b in range(1, batch_size):  # padded sequences of different lengths
            mask[b, self.seq_len - (b * 5) % self.seq_len:] = 0
        return ids, mask
