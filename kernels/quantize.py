"""accelc::quantize_per_token — symmetric int8 quantization of activations, one scale per row.

For x (..., K) in fp16 / bf16 / fp32, each row r (a token) in one program:

    absmax_r = max_k |x[r, k] * smooth[k]|           (smooth: optional per-channel factor)
    scale_r  = absmax_r / 127
    q[r, k]  = clamp(rint(x[r, k] * smooth[k] * (127 / absmax_r)), -127, 127)   int8

Returns (q (..., K) int8, scale (...,) fp32), so that x * smooth ~= q * scale[..., None]. With
`static_scale` (a one-element fp32 tensor from calibration) every row uses that scale instead
of its own absmax, and values past it saturate at +-127. `smooth` is SmoothQuant's (Xiao et al.
2023) 1 / s: the activation's outlier channels are divided down and the weight's columns
multiplied up by s at optimize time (accelc.passes.int8), so x W^T is unchanged.

Rounding is half to even, in fp32, after one IEEE multiply: the same operations as
quantize_ref, so the kernel and the reference agree bit for bit. Divisions use tl.div_rn
(Triton's `/` on fp32 is an approximate division), and rint is libdevice's on the GPU; the
CPU interpreter lacks libdevice, so there it rounds by adding and subtracting 1.5 * 2^23, which
is exact round-half-to-even for |y| < 2^22 (|y| <= 127 here).

A row of zeros gets scale 0 and q = 0 (absmax is clamped to 1e-30 for the division 127 / absmax).
"""
from __future__ import annotations

import math

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from accelc import runtime

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_EPS = 1e-30            # absmax floor: 127 / 1e-30 is still a finite fp32
_ROUND_MAGIC = 12582912.0   # 1.5 * 2^23


@triton.jit
def rint(y, USE_LIBDEVICE: tl.constexpr):
    """Round half to even: libdevice's rint on the GPU, the 1.5 * 2^23 trick in the interpreter."""
    if USE_LIBDEVICE:
        return libdevice.rint(y)
    else:
        return (y + 12582912.0) - 12582912.0


@triton.jit
def _quantize_kernel(
    # pointers
    x_ptr, smooth_ptr, static_ptr, q_ptr, scale_ptr,
    # sizes and strides (rows of x may be strided; q is contiguous)
    K, stride_xm, stride_xk,
    # meta-parameters
    HAS_SMOOTH: tl.constexpr, STATIC: tl.constexpr, USE_LIBDEVICE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    offs = tl.arange(0, BLOCK_K)
    if STATIC:
        scale = tl.load(static_ptr)
        inv = tl.div_rn(1.0, scale)
    else:
        # pass 1: the row's absmax (a second read of the row, in pass 2, hits in L2)
        absmax = tl.zeros((BLOCK_K,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ok = k0 + offs < K
            x = tl.load(x_row + (k0 + offs) * stride_xk, mask=ok, other=0.0).to(tl.float32)
            if HAS_SMOOTH:
                x = x * tl.load(smooth_ptr + k0 + offs, mask=ok, other=0.0)
            absmax = tl.maximum(absmax, tl.abs(x))
        amax = tl.max(absmax, 0)
        scale = tl.div_rn(amax, 127.0)
        inv = tl.div_rn(127.0, tl.maximum(amax, 1e-30))
    # pass 2: quantize. A row holding NaN or inf gets a NaN scale, so its int8 layer's output row
    # is NaN (as eager's float layer gives NaN or inf there), never finite numbers: max ignores
    # NaN and clamping maps it to -127
    nonfinite = tl.zeros((BLOCK_K,), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + offs < K
        x = tl.load(x_row + (k0 + offs) * stride_xk, mask=ok, other=0.0).to(tl.float32)
        if HAS_SMOOTH:
            x = x * tl.load(smooth_ptr + k0 + offs, mask=ok, other=0.0)
        nonfinite = tl.maximum(nonfinite, tl.where(tl.abs(x) < float("inf"), 0, 1))
        y = rint(x * inv, USE_LIBDEVICE)
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        tl.store(q_ptr + row * K + k0 + offs, y.to(tl.int8), mask=ok)
    tl.store(scale_ptr + row, tl.where(tl.max(nonfinite, 0) > 0, float("nan"), scale))


def why_unsupported(x, smooth=None, static_scale=None) -> str | None:
    """Why accelc::quantize_per_token cannot take these operands, or None (meta tensors are fine)."""
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not supported (fp16, bf16, fp32)"
    if x.dim() < 1:
        return "x must have at least one dim (..., K)"
    K = x.shape[-1]
    if smooth is not None and (tuple(smooth.shape) != (K,) or smooth.dtype != torch.float32):
        return f"smooth must be a ({K},) fp32 vector, got {tuple(smooth.shape)} {smooth.dtype}"
    if static_scale is not None and (static_scale.numel() != 1 or static_scale.dtype != torch.float32):
        return "static_scale must be a one-element fp32 tensor"
    for name, t in (("smooth", smooth), ("static_scale", static_scale)):
        if t is not None and t.device != x.device:
            return f"{name} is on {t.device} but x is on {x.device}"
    return None


def _check(x, smooth, static_scale):
    reason = why_unsupported(x, smooth, static_scale)
    if reason is not None:
        raise ValueError(f"accelc::quantize_per_token: {reason}")


def quantize_launch(x, smooth=None, static_scale=None):
    """Checks, allocates, launches. x (..., K) -> (q (..., K) int8, scale (...,) fp32)."""
    _check(x, smooth, static_scale)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M > 0 and K > 0:
        # up to 4096 columns a step: a 4096-wide row of K=4096 is one step, 4 warps
        block = min(triton.next_power_of_2(K), 4096)
        with runtime.device_guard(x2):
            _quantize_kernel[(M,)](
                x2, smooth if smooth is not None else scale, static_scale if static_scale is not None else scale,
                q, scale, K, x2.stride(0), x2.stride(1),
                HAS_SMOOTH=smooth is not None, STATIC=static_scale is not None,
                USE_LIBDEVICE=not runtime.interpreted(), BLOCK_K=block, num_warps=4 if block <= 2048 else 8)
    elif M > 0:
        scale.zero_()
    return q.reshape(x.shape), scale.reshape(x.shape[:-1])


def quantize_ref(x, smooth=None, static_scale=None):
    """Pure-PyTorch reference: the kernel's fp32 operations in the same order."""
    xf = x.float()
    if smooth is not None:
        xf = xf * smooth
    if static_scale is not None:
        scale = static_scale.reshape(()).expand(xf.shape[:-1]).clone()
        inv = torch.ones_like(static_scale.reshape(())) / static_scale.reshape(())
    else:
        amax = xf.abs().amax(-1) if xf.shape[-1] else xf.new_zeros(xf.shape[:-1])
        # tensor / tensor: PyTorch computes `127.0 / t` as 127 * (1 / t) and, on CUDA, `t / 127.0`
        # as t * (1 / 127), each rounded twice; the kernel's divisions are correctly rounded
        c127 = torch.full_like(amax, 127.0)
        scale = amax / c127
        inv = (c127 / amax.clamp_min(_EPS))[..., None]
    q = torch.round(xf * inv).clamp(-127, 127).nan_to_num(-127.0).to(torch.int8)
    if xf.shape[-1]:
        scale = scale.masked_fill(~torch.isfinite(xf).all(-1), math.nan)
    return q, scale


@torch.library.custom_op("accelc::quantize_per_token", mutates_args=())
def quantize_per_token(x: torch.Tensor, smooth: Optional[torch.Tensor] = None,
                       static_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, fp32 row scales) of x: see the module docstring."""
    _check(x, smooth, static_scale)
    return runtime.launch_or_fallback("quantize_per_token", x.device, quantize_launch, quantize_ref, x, smooth,
                                      static_scale)


@quantize_per_token.register_fake
def _(x, smooth=None, static_scale=None):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[:-1], dtype=torch.float32)


__all__ = ["quantize_per_token", "quantize_launch", "quantize_ref", "rint", "why_unsupported"]
