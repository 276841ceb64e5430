"""accelc::rotary_embedding — rotary position embedding (RoPE) in one kernel:

    out = x * cos + rotate_half(x) * sin,    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])

as HF's Llama / Mistral / Qwen / Gemma / GPT-NeoX `apply_rotary_pos_emb` writes it (eager: two
slices, a neg, a cat, two muls and an add, seven kernels and six intermediate tensors a call).

x (..., L, D) of rank 1 to 4 with D even, any strides (the transposes that split heads are read
through their strides); cos and sin broadcastable to x (HF: (B, 1, L, D) against (B, H, L, D)), read
through stride-0 broadcasts, never expanded. One program handles ROWS rows of D values: it loads
the row, the row with its halves swapped, and the cos / sin rows, computes in fp32 and stores once.
The result has the dtype eager's expression has (x's, cos's and sin's promoted), contiguous.
Eager rounds each of its three products and sums to half precision; the kernel rounds once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from accelc import runtime
from accelc.tuning import check_once

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_D = 1024


@triton.jit(do_not_specialize=["M", "A1", "A2"])  # sizes that follow the batch or length: one binary for every size
def _rotary_kernel(x_ptr, c_ptr, s_ptr, y_ptr, M, A1, A2, D,
                   sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
                   ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # rows of the (A0, A1, A2) leading dims, flattened; the row's (a0, a1, a2) from its index
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    a2 = rows % A2
    a1 = (rows // A2) % A1
    a0 = rows // (A2 * A1)
    half = D // 2
    cols = tl.arange(0, BLOCK_D)
    swapped = tl.where(cols < half, cols + half, cols - half)      # rotate_half's source column
    ok = (rows[:, None] < M) & (cols[None, :] < D)
    x_row = x_ptr + (a0 * sx0 + a1 * sx1 + a2 * sx2)[:, None]
    x = tl.load(x_row + cols[None, :] * sx3, mask=ok, other=0.0).to(tl.float32)
    xs = tl.load(x_row + swapped[None, :] * sx3, mask=ok, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + (a0 * sc0 + a1 * sc1 + a2 * sc2)[:, None] + cols[None, :] * sc3, mask=ok,
                other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (a0 * ss0 + a1 * ss1 + a2 * ss2)[:, None] + cols[None, :] * ss3, mask=ok,
                other=0.0).to(tl.float32)
    rot = tl.where(cols[None, :] < half, -xs, xs)
    y = x * c + rot * s
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


def why_unsupported(x, cos, sin) -> str | None:
    """Why accelc::rotary_embedding cannot take these operands, or None (meta tensors are fine)."""
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if t.dtype not in SUPPORTED_DTYPES:
            return f"{name} has dtype {t.dtype} (fp16, bf16, fp32 are supported)"
        if t.device != x.device:
            return f"{name} is on {t.device} but x is on {x.device}"
    if not 1 <= x.dim() <= 4:
        return f"x has {x.dim()} dims (1 to 4 are supported)"
    D = x.shape[-1]
    if D % 2 or D > MAX_D:
        return f"the rotated dim is {D} (an even size up to {MAX_D} is supported)"
    for name, t in (("cos", cos), ("sin", sin)):
        try:
            shape = torch.broadcast_shapes(t.shape, x.shape)
        except RuntimeError:
            shape = None
        if shape != x.shape:
            return f"{name} {tuple(t.shape)} does not broadcast to x's shape {tuple(x.shape)}"
    return None


_CHECKED: set = set()   # call signatures why_unsupported accepted


def _check(x, cos, sin):
    """why_unsupported as a one-line ValueError, once per call signature."""
    sig = tuple((t.shape, t.stride(), t.dtype, t.device) for t in (x, cos, sin))
    check_once(_CHECKED, sig, lambda: why_unsupported(x, cos, sin), "rotary_embedding")


def out_dtype(x, cos, sin) -> torch.dtype:
    """The dtype of eager's x * cos + rotate_half(x) * sin."""
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def _strides4(t: torch.Tensor, shape: torch.Size) -> list:
    """t's strides broadcast to `shape` (0 where t has size 1 or lacks the dim), left-padded to
    four dims; arithmetic only, no view made."""
    lead = len(shape) - t.dim()
    strides = [0 if i < lead or t.shape[i - lead] == 1 else t.stride(i - lead) for i in range(len(shape))]
    return [0] * (4 - len(strides)) + strides


def rotary_embedding_launch(x, cos, sin):
    _check(x, cos, sin)
    out = torch.empty(x.shape, dtype=out_dtype(x, cos, sin), device=x.device)
    D = x.shape[-1]
    if not out.numel():
        return out
    lead = [1] * (4 - x.dim()) + list(x.shape)
    A0, A1, A2 = lead[:3]
    M = A0 * A1 * A2
    block = triton.next_power_of_2(D)
    rows = max(1, min(16, 2048 // block))
    warps = 4 if block * rows <= 2048 else 8
    with runtime.device_guard(x):
        _rotary_kernel[(triton.cdiv(M, rows),)](
            x, cos, sin, out, M, A1, A2, D, *_strides4(x, x.shape), *_strides4(cos, x.shape),
            *_strides4(sin, x.shape), ROWS=rows, BLOCK_D=block, num_warps=warps)
    return out


def rotary_embedding_ref(x, cos, sin):
    """Eager's expression (HF's apply_rotary_pos_emb for one tensor), in the operands' dtypes."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@torch.library.custom_op("accelc::rotary_embedding", mutates_args=())
def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in one kernel: see the module docstring."""
    _check(x, cos, sin)
    return runtime.launch_or_fallback("rotary_embedding", x.device, rotary_embedding_launch, rotary_embedding_ref,
                                      x, cos, sin)


@rotary_embedding.register_fake
def _(x, cos, sin):
    return torch.empty(x.shape, dtype=out_dtype(x, cos, sin), device=x.device)


__all__ = ["rotary_embedding", "rotary_embedding_launch", "rotary_embedding_ref", "why_unsupported"]
