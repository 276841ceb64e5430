"""The index of each row's largest value (B, V) -> (B,) int64, as torch.argmax(x, -1) gives it: the
first of tied maxima, and the first NaN where a row holds one (a NaN is larger than everything).

Greedy decoding takes one a token over the vocabulary's logits (accelc.generation). PyTorch reduces
a row in one block of threads: about 28 us a token at Llama-3's 128256 entries on an H100, where the
decode step itself is ~6 ms. Here two kernels:
  1. _chunk_kernel, one program per (row, CHUNK entries): the chunk's first NaN, or else its max and
     the first index of it;
  2. _rows_kernel, one program a row: the same over the chunks' results (a chunk's NaN first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from accelc import runtime

CHUNK = 2048        # entries a program of the first kernel reads (16 a thread of 4 warps)
BIG = 2**31 - 1     # an index past every row


@triton.jit
def _pick(vals, idx, ok, BIG_I: tl.constexpr):
    """(value, index) of a block: its first NaN (value NaN), or its max and the first index holding it."""
    nan = (vals != vals) & ok
    first_nan = tl.min(tl.where(nan, idx, BIG_I), 0)
    plain = tl.where(nan | ~ok, float("-inf"), vals)
    m = tl.max(plain, 0)
    first_max = tl.min(tl.where((plain == m) & ok, idx, BIG_I), 0)
    has_nan = first_nan < BIG_I
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, first_nan, first_max)


@triton.jit
def _chunk_kernel(x_ptr, val_ptr, idx_ptr, V, stride_b, CHUNKS, BLOCK: tl.constexpr, BIG_I: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    vals = tl.load(x_ptr + row.to(tl.int64) * stride_b + offs, mask=ok, other=float("-inf")).to(tl.float32)
    v, i = _pick(vals, offs, ok, BIG_I)
    tl.store(val_ptr + row * CHUNKS + c, v)
    tl.store(idx_ptr + row * CHUNKS + c, i)


@triton.jit
def _rows_kernel(val_ptr, idx_ptr, out_ptr, CHUNKS, BLOCK: tl.constexpr, BIG_I: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < CHUNKS
    vals = tl.load(val_ptr + row * CHUNKS + offs, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * CHUNKS + offs, mask=ok, other=BIG_I)
    _, i = _pick(vals, idx, ok, BIG_I)       # a chunk's NaN is its first NaN; chunks are in index order
    tl.store(out_ptr + row, i.to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of a 2-D float tensor whose rows are contiguous; other input goes to torch."""
    if (x.dim() != 2 or x.stride(-1) != 1 or not x.dtype.is_floating_point or x.dtype == torch.float64
            or x.shape[0] == 0 or x.shape[1] == 0 or x.shape[1] >= BIG or not runtime.can_run_on(x.device)):
        return x.argmax(-1)
    B, V = x.shape
    chunk = min(CHUNK, max(16, triton.next_power_of_2(V)))
    chunks = triton.cdiv(V, chunk)
    vals = torch.empty((B, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((B, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(B, dtype=torch.int64, device=x.device)
    with runtime.device_guard(x):
        _chunk_kernel[(B, chunks)](x, vals, idx, V, x.stride(0), chunks, BLOCK=chunk, BIG_I=BIG, num_warps=4)
        _rows_kernel[(B,)](vals, idx, out, chunks, BLOCK=max(16, triton.next_power_of_2(chunks)), BIG_I=BIG,
                           num_warps=4)
    return out
