"""fp8 attention's operands (Fp8Config(attention=True)): q, K and V quantized to e4m3 once, before the attention
kernel, as FlashAttention-3's fp8 forward takes them. q and K a row (a token) at a time over the head dim; V a
head-dim column at a time over all its keys, written transposed (keys contiguous: the operand order the fp8 tensor
cores take for p @ V). Each scale is the slice's largest magnitude / 448 (e4m3's largest), 0 for a slice of zeros,
NaN for one holding NaN or inf (max ignores NaN and the clamp would make inf finite: the products stay NaN, as
eager's). The attention kernel multiplies q @ K^T by the q row's and the key's scales, and its output by V's
column scales once at the end (a column's scale is the same for every key block).

An earlier form quantized each K and V block in the attention kernel's registers as it loaded them: every query
block quantized the whole of K and V again, and the kernel ran 3.8x-7.9x slower than the fp16 one (H200).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from accelc import runtime
from accelc.kernels.primitives import e4m3_inverse, e4m3_scale, nonfinite, scaled_e4m3

E4M3 = torch.float8_e4m3fn


@triton.jit
def _e4m3(t, amax, AXIS: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    return scaled_e4m3(t, tl.expand_dims(e4m3_inverse(amax), AXIS), ROUND_BY_HAND)


@triton.jit
def _rows_kernel(x_ptr, out_ptr, scale_ptr, HN, N, stride_b, stride_h, stride_n, stride_d,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """(B, Hn, N, D) -> e4m3 (B, Hn, N, D) contiguous and a scale a row (B, Hn, N)."""
    bh = tl.program_id(1)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_r < N)[:, None] & (offs_d < D)[None, :]
    x = tl.load(x_ptr + (bh // HN) * stride_b + (bh % HN) * stride_h + offs_r[:, None] * stride_n
                + offs_d[None, :] * stride_d, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    bad = nonfinite(x, 1)
    tl.store(out_ptr + (bh * N + offs_r[:, None]) * D + offs_d[None, :], _e4m3(x, amax, 1, ROUND_BY_HAND), mask=ok)
    tl.store(scale_ptr + bh * N + offs_r, e4m3_scale(amax, bad), mask=offs_r < N)


@triton.jit
def _columns_kernel(x_ptr, out_ptr, scale_ptr, HN, N, N_PAD, stride_b, stride_h, stride_n, stride_d,
                    D: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    """(B, Hn, N, D) -> e4m3 transposed (B, Hn, D, N_PAD) and a scale a column (B, Hn, D): two passes over the
    rows, the columns' largest magnitudes, then the quantized values."""
    bh = tl.program_id(1)
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < D
    base = x_ptr + (bh // HN) * stride_b + (bh % HN) * stride_h + offs_c[None, :] * stride_d
    amax = tl.zeros((BLOCK_C,), tl.float32)
    bad = tl.zeros((BLOCK_C,), tl.int32)
    for start in range(0, N, BLOCK_R):
        offs_r = start + tl.arange(0, BLOCK_R)
        x = tl.load(base + offs_r[:, None] * stride_n, mask=(offs_r < N)[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
        bad = tl.maximum(bad, nonfinite(x, 0))
    for start in range(0, N, BLOCK_R):
        offs_r = start + tl.arange(0, BLOCK_R)
        ok = (offs_r < N)[:, None] & c_ok[None, :]
        x = tl.load(base + offs_r[:, None] * stride_n, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + (bh * D + offs_c[None, :]) * N_PAD + offs_r[:, None], _e4m3(x, amax, 0, ROUND_BY_HAND),
                 mask=ok)
    tl.store(scale_ptr + bh * D + offs_c, e4m3_scale(amax, bad), mask=c_ok)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, Hn, N, D), any strides -> (e4m3 (B, Hn, N, D) contiguous, fp32 scales (B, Hn, N))."""
    B, HN, N, D = x.shape
    out = torch.empty((B, HN, N, D), dtype=E4M3, device=x.device)
    scale = torch.empty((B, HN, N), dtype=torch.float32, device=x.device)
    if x.numel():
        block_d = triton.next_power_of_2(D)
        block_r = max(1, min(64, 8192 // block_d, triton.next_power_of_2(N)))
        _rows_kernel[(triton.cdiv(N, block_r), B * HN)](
            x, out, scale, HN, N, *x.stride(), D=D, BLOCK_D=block_d, BLOCK_R=block_r,
            ROUND_BY_HAND=runtime.interpreted())
    return out, scale


def quantize_columns_transposed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, Hn, N, D), any strides -> (e4m3 as a (B, Hn, N, D) view of a (B, Hn, D, N_PAD) buffer: keys
    contiguous, each column's row padded to 16 bytes; fp32 scales (B, Hn, D), one a head-dim column)."""
    B, HN, N, D = x.shape
    n_pad = -(-max(N, 1) // 16) * 16
    buf = torch.empty((B, HN, D, n_pad), dtype=E4M3, device=x.device)
    scale = torch.empty((B, HN, D), dtype=torch.float32, device=x.device)
    if x.numel():
        block_c = min(32, triton.next_power_of_2(D))
        block_r = max(1, min(128, triton.next_power_of_2(N)))
        _columns_kernel[(triton.cdiv(D, block_c), B * HN)](
            x, buf, scale, HN, N, n_pad, *x.stride(), D=D, BLOCK_C=block_c, BLOCK_R=block_r,
            ROUND_BY_HAND=runtime.interpreted())
    return buf[..., :N].transpose(2, 3), scale
