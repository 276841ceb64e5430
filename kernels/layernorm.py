"""accelc::layer_norm and accelc::rms_norm — LayerNorm / RMSNorm over the last dim, with an
optional residual added first (ONNX Runtime's SkipLayerNormalization; the post-norm block
`LayerNorm(x + sublayer(x))`).

For x (..., N) in fp16 / bf16 / fp32, each row in one program, statistics in fp32:

    h = x + residual          (rounded to x's dtype, as eager's add is; when residual is given)
    y = (h - mean(h)) * rsqrt(mean((h - mean(h))^2) + eps) * weight + bias

    y = h * rsqrt(mean(h^2) + eps) * weight                       (RMSNorm: Llama, T5, Mistral)

weight and bias (N,) are optional (elementwise_affine=False, bias=False). The variance is the
two-pass form over the row held in registers (no E[h^2] - E[h]^2 cancellation). A row holding NaN
or inf gives NaN in the whole row, as eager's LayerNorm does (RMSNorm: inf gives NaN where eager's
inf * rsqrt(inf) does, NaN the row). Rows up to MAX_N wide. One kernel, RMS a constexpr.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from accelc import runtime
from accelc.tuning import check_once

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_N = 16384          # one row in registers: 16384 fp32 values over 16 warps


@triton.jit(do_not_specialize=["M"])  # sizes that follow the batch or length: one binary for every size
def _layer_norm_kernel(
    x_ptr, r_ptr, w_ptr, b_ptr, y_ptr,
    M, N, stride_x, stride_r, eps,
    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # ROWS rows a program: narrow rows (768 wide) would leave one program too little to do
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    ok = (rows[:, None] < M) & (cols[None, :] < N)
    h = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    if HAS_RES:
        # eager adds in the input dtype, then normalizes the rounded sum
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
    h = h.to(tl.float32)
    if RMS:
        d = tl.where(ok, h, 0.0)
    else:
        mean = tl.sum(h, 1) / N
        d = tl.where(ok, h - mean[:, None], 0.0)
    var = tl.sum(d * d, 1) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    y = d * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def why_unsupported(x, weight=None, bias=None, residual=None, normalized_shape=None) -> str | None:
    """Why accelc::layer_norm cannot take these operands, or None (meta tensors are fine)."""
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not supported (fp16, bf16, fp32)"
    if x.dim() < 1:
        return "x must have at least one dim (..., N)"
    N = x.shape[-1]
    if normalized_shape is not None and tuple(normalized_shape) != (N,):
        return f"normalizes over {tuple(normalized_shape)}: only the last dim ({N},) is supported"
    if N > MAX_N:
        return f"rows of {N} are wider than {MAX_N}"
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (tuple(t.shape) != (N,) or t.dtype not in SUPPORTED_DTYPES):
            return f"{name} must be a ({N},) float vector, got {tuple(t.shape)} {t.dtype}"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return (f"the residual {tuple(residual.shape)} {residual.dtype} is not x's shape and dtype "
                f"{tuple(x.shape)} {x.dtype} (a broadcast add stays PyTorch)")
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and t.device != x.device:
            return f"{name} is on {t.device} but x is on {x.device}"
    return None


_CHECKED: set = set()   # call signatures why_unsupported accepted


def _check(x, weight, bias, residual, op="layer_norm"):
    """why_unsupported as a one-line ValueError naming the op, once per call signature."""
    sig = (op, *((None if t is None else (t.shape, t.dtype, t.device)) for t in (x, weight, bias, residual)))
    check_once(_CHECKED, sig, lambda: why_unsupported(x, weight, bias, residual), op)


def layer_norm_launch(x, weight=None, bias=None, residual=None, eps=1e-5, rms=False):
    """Checks, allocates, launches. x (..., N) -> y (..., N) in x's dtype, contiguous."""
    _check(x, weight, bias, residual, "rms_norm" if rms else "layer_norm")
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if N and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, N)
        if N and r2.stride(-1) != 1:
            r2 = r2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        block = triton.next_power_of_2(N)
        rows = max(1, min(8, 2048 // block))       # about 2048 values a program
        warps = 4 if block * rows <= 2048 else 8 if block <= 4096 else 16
        dummy = x2
        with runtime.device_guard(x2):
            _layer_norm_kernel[(triton.cdiv(M, rows),)](
                x2, r2 if r2 is not None else dummy, weight if weight is not None else dummy,
                bias if bias is not None else dummy, y, M, N, x2.stride(0), r2.stride(0) if r2 is not None else 0,
                float(eps), HAS_RES=r2 is not None, HAS_W=weight is not None, HAS_B=bias is not None,
                RMS=bool(rms), ROWS=rows, BLOCK_N=block, num_warps=warps)
    return y.reshape(x.shape)


def layer_norm_ref(x, weight=None, bias=None, residual=None, eps=1e-5):
    """Pure-PyTorch reference: eager's add in x's dtype, then LayerNorm in fp32."""
    h = x if residual is None else x + residual
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(h.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


@torch.library.custom_op("accelc::layer_norm", mutates_args=())
def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               residual: Optional[torch.Tensor] = None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm(x (+ residual)) over the last dim: see the module docstring."""
    _check(x, weight, bias, residual)
    return runtime.launch_or_fallback("layer_norm", x.device, layer_norm_launch, layer_norm_ref, x, weight, bias,
                                      residual, eps)


@layer_norm.register_fake
def _(x, weight=None, bias=None, residual=None, eps=1e-5):
    return x.new_empty(x.shape)


def rms_norm_launch(x, weight=None, residual=None, eps=1e-6):
    return layer_norm_launch(x, weight, None, residual, eps, rms=True)


def rms_norm_ref(x, weight=None, residual=None, eps=1e-6):
    """Pure-PyTorch reference: eager's add in x's dtype, then RMSNorm in fp32."""
    h = (x if residual is None else x + residual).float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


@torch.library.custom_op("accelc::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None,
             eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm(x (+ residual)) over the last dim: see the module docstring."""
    _check(x, weight, None, residual, "rms_norm")
    return runtime.launch_or_fallback("rms_norm", x.device, rms_norm_launch, rms_norm_ref, x, weight, residual, eps)


@rms_norm.register_fake
def _(x, weight=None, residual=None, eps=1e-6):
    return x.new_empty(x.shape)


__all__ = ["layer_norm", "layer_norm_launch", "layer_norm_ref", "rms_norm", "rms_norm_launch", "rms_norm_ref",
           "why_unsupported", "MAX_N"]
