"""accelc::paged_attention: one generation step's attention over a paged KV cache (vLLM's
PagedAttention; accelc.paged_cache owns the cache), the step's keys and values already written to
it.

A step is T query columns a sequence, of which its last new[b] are its real new tokens: a
left-padded prompt's pads come first, and a row the request does not use has none. Two paths,
chosen when the step runs (T is one dim of a program that serves prefill and decode alike):
  - T <= flash_decoding.MAX_QUERIES (a decode step, a short prompt): flash_decoding.paged over the
    cache, each sequence's keys read through its block table up to its own length, nothing read
    for padding; fp16 / bf16 (fp32: flash_attention over the sequence's keys gathered from the
    table, the same numbers, not the bandwidth);
  - more columns (a prompt): the step starts its sequences (the cache holds none of their keys
    before it; accelc.paged_cache's callers keep to that), so the step attends among its own
    tokens, causal, the pads masked: flash_attention (is_causal and a key padding mask) on the
    step's keys and values, the cache not read.
A pad column's row is never used by the model's output (rows are independent but for attention,
and nothing attends to a pad): its value is whatever its path gives, 0 for a row with no key.
"""
from __future__ import annotations

from typing import Optional

import torch

from accelc import runtime
from accelc.kernels import flash_decoding
from accelc.kernels.flash_attention import flash_attention, flash_attention_ref


def _out(q: torch.Tensor) -> torch.Tensor:
    """The output in the layout HF's attention returns: (B, T, H, D) memory seen as (B, H, T, D)."""
    B, H, T, D = q.shape
    return q.new_empty((B, T, H, D)).transpose(1, 2)


def real_columns(new: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) bool: column t of sequence b is one of its real new tokens (its last new[b])."""
    col = torch.arange(T, device=new.device)
    return col[None, :] >= (T - new.long())[:, None]


def _gathered(k_cache, v_cache, block_table):
    """Each sequence's whole table of keys and values in order, (B, Hkv, pages x page, D)."""
    blocks, page, Hkv, D = k_cache.shape
    rows = (block_table.long()[:, :, None] * page + torch.arange(page, device=block_table.device)).flatten(1)
    return [c.reshape(blocks * page, Hkv, D)[rows].permute(0, 2, 1, 3) for c in (k_cache, v_cache)]


def _decode_mask(seq_lens: torch.Tensor, T: int, S: int) -> torch.Tensor:
    """(B, 1, T, S) bool: column t of a sequence of n keys sees keys s < n - (T - 1 - t)."""
    col = torch.arange(T, device=seq_lens.device)
    limit = seq_lens.long()[:, None] - (T - 1 - col)[None, :]                   # (B, T)
    return (torch.arange(S, device=seq_lens.device)[None, None, :] < limit[:, :, None])[:, None]


def kernel_takes(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether flash_decoding.paged serves the step (else the gathered keys do)."""
    B, H, T, D = q.shape
    return (q.dtype in (torch.float16, torch.bfloat16) and T <= flash_decoding.MAX_QUERIES
            and (H // k_cache.shape[2]) * T <= flash_decoding.MAX_ROWS and runtime.can_run_on(q.device))


def paged_attention_launch(q, k, v, k_cache, v_cache, block_table, seq_lens, new, scale=None):
    """The op's body (accelc.kernels.LAUNCHERS: the runner calls it directly)."""
    return _attend(q, k, v, k_cache, v_cache, block_table, seq_lens, new, scale, flash_attention, kernel=True)


def paged_attention_ref(q, k, v, k_cache, v_cache, block_table, seq_lens, new, scale=None):
    """Pure PyTorch, the same paths (an ONNX export's stand-in, accelc.kernels.REFERENCES)."""
    return _attend(q, k, v, k_cache, v_cache, block_table, seq_lens, new, scale, flash_attention_ref, kernel=False)


def _attend(q, k, v, k_cache, v_cache, block_table, seq_lens, new, scale, attention, kernel: bool):
    """The step's attention by its path (the module docstring), `attention` flash_attention's
    signature; kernel: flash_decoding.paged may serve a short step."""
    T = q.shape[2]
    out = _out(q)
    if T > flash_decoding.MAX_QUERIES:           # a prompt: among its own tokens
        # causal (the kernel skips the key blocks right of the diagonal) over the real keys: a key padding
        # mask, read once a key block; a pad column sees only pads before it, an empty row
        real = real_columns(new, T)[:, None, None, :]
        return out.copy_(attention(q, k, v, real, is_causal=True, scale=scale))
    if kernel and kernel_takes(q, k_cache):
        return flash_decoding.paged(q, k_cache, v_cache, block_table, seq_lens, scale=scale, out=out)
    keys, values = _gathered(k_cache, v_cache, block_table)
    return out.copy_(attention(q, keys, values, _decode_mask(seq_lens, T, keys.shape[2]), scale=scale))


@torch.library.custom_op("accelc::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, new: torch.Tensor,
                    scale: Optional[float] = None) -> torch.Tensor:
    """Attention of q (B, H, T, D) for a step whose keys and values k, v (B, Hkv, T, D) are already
    in k_cache / v_cache (blocks, page, Hkv, D) through block_table (B, pages); seq_lens (B,): each
    sequence's keys, the step's included; new (B,): its real columns, the last ones. See the module
    docstring. Returns (B, H, T, D)."""
    return paged_attention_launch(q, k, v, k_cache, v_cache, block_table, seq_lens, new, scale)


@paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, block_table, seq_lens, new, scale=None):
    return _out(q)
