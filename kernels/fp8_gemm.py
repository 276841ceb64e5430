"""accelc::linear_fp8 — fp8 (e4m3) weights and activations (Fp8Config(weights_only=False)).

For x (..., K) in fp16 / bf16 / fp32 and a weight quantized once at optimize time (fp8_weight.quantize_weight:
w_q (N, K) float8_e4m3fn, w_scale (N,) fp32 per output channel):

    q, a_scale = quantize_rows(x)          each row scaled so that its largest magnitude is e4m3's 448
    out = act((q @ w_q^T) * a_scale[:, None] * w_scale[None, :] + bias) (+ residual)     in x's dtype

The product runs on fp8 operands with fp32 accumulators (accelc::linear's QUANT=4: tl.dot on e4m3 tiles, which
Hopper's tensor cores run at twice fp16's rate; for half outputs also the warp-specialized Gluon GEMM's W8A8
candidates on fp8), the scales applied before the epilogue. Row-wise dynamic scales
keep e4m3's range on every token, so no calibration is needed. A row holding NaN or inf gets a NaN scale: its
output row is NaN, as eager's float layer gives NaN or inf there, never finite numbers.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from accelc import runtime
from accelc.kernels import gated_linear, gemm, int8_gemm
from accelc.kernels.epilogue import activation_ref, epilogue_ref, residual_as
from accelc.kernels.fp8_weight import DTYPE, E4M3_MAX
from accelc.kernels.int8_gemm import weight_problem
from accelc.kernels.primitives import e4m3_inverse, e4m3_scale, nonfinite, nonfinite_each, scaled_e4m3
from accelc.tuning import Tuner, check_once

# the int8 candidates (the same bytes a stage: one-byte operands), the warp-specialized Gluon ones included
# (gemm_hopper.linear_ws_kernel with QUANT=2: fp8 wgmma, fp32 accumulators; half outputs)
CONFIGS = list(int8_gemm.CONFIGS)
TUNER = Tuner("linear_fp8", gemm.linear_kernel, CONFIGS, prune=gemm.prune_configs,
              default=gemm.default_config, interpreter=gemm.interpreter_config, other_kernels=gemm.other_kernels)
# the gated MLP's gate / up pair on fp8 weights and activations: the same candidates (tl kernels only: the Gluon
# GEMM has no gated epilogue)
GATED_TUNER = Tuner("gated_linear_fp8", gemm.linear_kernel, CONFIGS, prune=gemm.prune_configs,
                    default=gemm.default_config, interpreter=gemm.interpreter_config, other_kernels=gemm.other_kernels)
_CHECKED: set = set()


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_xk, norm_ptr, norm_eps,
                          ROUND_BY_HAND: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
                          NORM: tl.constexpr = False):
    """One row a program. ONE_PASS (the row within one block): the row read once and held in registers;
    otherwise read twice, its largest magnitude first (the second read mostly from L2). NORM (ONE_PASS only):
    the row RMS-normalized first (weight norm_ptr (K,), eps norm_eps), the norm before the projection in the
    quantization's own read."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    offs = tl.arange(0, BLOCK_K)
    if ONE_PASS:
        ok = offs < K
        x = tl.load(x_row + offs * stride_xk, mask=ok, other=0.0).to(tl.float32)
        if NORM:
            rstd = tl.rsqrt(tl.sum(x * x, 0) / K + norm_eps)
            x = x * rstd * tl.load(norm_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
        bad = nonfinite(x, 0)
    else:
        absmax = tl.zeros((BLOCK_K,), tl.float32)
        bad_each = tl.zeros((BLOCK_K,), tl.int32)
        for k0 in range(0, K, BLOCK_K):
            ok = k0 + offs < K
            x = tl.load(x_row + (k0 + offs) * stride_xk, mask=ok, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.abs(x))
            bad_each = tl.maximum(bad_each, nonfinite_each(x))
        amax = tl.max(absmax, 0)
        bad = tl.max(bad_each, 0)
    inv = e4m3_inverse(amax)
    tl.store(scale_ptr + row, e4m3_scale(amax, bad))
    if ONE_PASS:
        tl.store(q_ptr + row * K + offs, scaled_e4m3(x, inv, ROUND_BY_HAND), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK_K):
            ok = k0 + offs < K
            x = tl.load(x_row + (k0 + offs) * stride_xk, mask=ok, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * K + k0 + offs, scaled_e4m3(x, inv, ROUND_BY_HAND), mask=ok)


ONE_PASS_MAX_K = 16384   # a row of up to this many values held in one program's registers (64 a thread at 8 warps)
TWO_PASS_BLOCK = 1024    # a longer row's block


def quantize_rows(x2: torch.Tensor, norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 (M, K) float -> (q (M, K) float8_e4m3fn, scale (M,) fp32) with x2 ~= q * scale[:, None]. norm =
    (norm_weight (K,), eps): the rows RMS-normalized first (in the same kernel where a row fits its registers,
    else by the norm kernel before it)."""
    M, K = x2.shape
    q = torch.empty((M, K), dtype=DTYPE, device=x2.device)
    scale = torch.empty((M,), dtype=torch.float32, device=x2.device)
    if M > 0:
        one_pass = K <= ONE_PASS_MAX_K
        if norm is not None and not one_pass:
            from accelc.kernels.layernorm import rms_norm_launch
            x2, norm = rms_norm_launch(x2, norm[0], None, float(norm[1])), None
        block = max(triton.next_power_of_2(K), 16) if one_pass else TWO_PASS_BLOCK
        with runtime.device_guard(x2):
            _quantize_rows_kernel[(M,)](x2, q, scale, K, x2.stride(0), x2.stride(1),
                                        norm[0] if norm is not None else scale, float(norm[1]) if norm else 0.0,
                                        ROUND_BY_HAND=runtime.interpreted(), BLOCK_K=block, ONE_PASS=one_pass,
                                        NORM=norm is not None, num_warps=8 if block >= 4096 else 4)
    return q, scale


def quantize_rows_ref(x2: torch.Tensor, norm: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    x = gemm.rms_normed_ref(x2, *(norm if norm is not None else (None, None)), torch.float32)
    amax = x.abs().amax(1)
    bad = ~torch.isfinite(x).all(1)
    # (a tensor over a tensor: IEEE division, as the kernel's div_rn; a number over a tensor, or on a GPU a tensor
    # over a number, is a reciprocal times the other, a last bit apart, which moves a value sitting on a tie)
    e4m3_max = torch.full_like(amax, E4M3_MAX)
    scale = torch.where(bad, torch.full_like(amax, float("nan")), amax / e4m3_max)
    inv = e4m3_max / amax.clamp_min(1e-30)
    q = (x * inv[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(DTYPE)
    return q, scale


def why_unsupported(x, w_q, w_scale, bias=None, residual=None, activation="none") -> str | None:
    """Why accelc::linear_fp8 cannot take these operands, or None (meta tensors are fine)."""
    problem = weight_problem(x, w_q, w_scale, DTYPE)
    if problem:
        return problem
    if x.dtype not in gemm.SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not supported (fp16, bf16, fp32)"
    if x.shape[-1] % 16:
        return f"K={x.shape[-1]}: the fp8 tensor-core product takes K in multiples of 16"
    return gemm.epilogue_problem(x, w_q.shape[0], bias, residual, activation)


def _norm(norm_weight, norm_eps):
    return (norm_weight, float(norm_eps)) if norm_eps is not None else None


def linear_fp8_launch(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False,
                      norm_weight=None, norm_eps=None):
    """Checks, quantizes x's rows (RMS-normalized first where norm_eps is given, in the same kernel), launches.
    x (..., K), w_q (N, K) float8_e4m3fn, w_scale (N,) -> (..., N) in x's dtype."""
    sig = (x.shape, x.dtype, x.device, w_q.shape, w_q.dtype, w_scale.shape,
           None if bias is None else (bias.shape, bias.dtype), None if residual is None else residual.shape, activation,
           norm_eps is None)
    check_once(_CHECKED, sig, lambda: why_unsupported(x, w_q, w_scale, bias, residual, activation)
               or gemm.norm_problem(x, norm_weight, norm_eps), "linear_fp8")
    K, N = x.shape[-1], w_q.shape[0]
    out_shape = (*x.shape[:-1], N)
    q, a_scale = quantize_rows(x.reshape(-1, K), _norm(norm_weight, norm_eps))
    residual = residual_as(residual, out_shape)
    res2 = residual.reshape(-1, N) if residual is not None else None
    out = torch.empty((q.shape[0], N), dtype=x.dtype, device=x.device)
    if q.shape[0] > 0 and N > 0:
        gemm.launch(q, w_q, bias, res2, out, activation, residual_first, scales=(a_scale, w_scale), tuner=TUNER)
    return out.reshape(out_shape)


def linear_fp8_ref(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False,
                   norm_weight=None, norm_eps=None):
    """The same math in fp64: x's rows quantized as the kernel does, the fp8 products summed, then the scales."""
    K, N = x.shape[-1], w_q.shape[0]
    q, a_scale = quantize_rows_ref(x.reshape(-1, K), _norm(norm_weight, norm_eps))
    acc = (q.double() @ w_q.double().t()) * a_scale.double()[:, None] * w_scale.double()[None, :]
    res2 = residual.reshape(-1, N).double() if residual is not None else None
    bias = bias.double() if bias is not None else None
    out = epilogue_ref(acc, bias, res2, activation, residual_first).to(x.dtype)
    return out.reshape(*x.shape[:-1], N)


def gated_linear_fp8_launch(x, w_q, w_scale, bias, n, activation="silu", norm_weight=None, norm_eps=None):
    """Checks, quantizes x's rows, launches: act(gate) * up (..., n) in x's dtype; w_q (2 Np, K) float8_e4m3fn with
    the gate and up rows interleaved as gated_linear.pack makes them, w_scale (2 Np,), bias (2 Np,) or None."""
    sig = (x.shape, x.dtype, x.device, w_q.shape, w_q.dtype, w_scale.shape,
           None if bias is None else (bias.shape, bias.dtype), n, activation, "gated", norm_eps is None)
    check_once(_CHECKED, sig, lambda: gated_linear.packed_problem(w_q, n, activation)
               or why_unsupported(x, w_q, w_scale, bias, None, activation)
               or gemm.norm_problem(x, norm_weight, norm_eps), "gated_linear_fp8")
    K = x.shape[-1]
    q, a_scale = quantize_rows(x.reshape(-1, K), _norm(norm_weight, norm_eps))
    out = torch.empty((q.shape[0], n), dtype=x.dtype, device=x.device)
    if q.shape[0] > 0 and n > 0:
        gemm.launch(q, w_q, bias, None, out, activation, False, scales=(a_scale, w_scale), tuner=GATED_TUNER,
                    gated=True)
    return out.reshape(*x.shape[:-1], n)


def gated_linear_fp8_ref(x, w_q, w_scale, bias, n, activation="silu", norm_weight=None, norm_eps=None):
    """The same math in fp64: x's rows quantized as the kernel does, the fp8 products summed, the scales, then
    act(gate) * up on the unpacked halves."""
    K = x.shape[-1]
    q, a_scale = quantize_rows_ref(x.reshape(-1, K), _norm(norm_weight, norm_eps))
    w = w_q.double() * w_scale.double()[:, None]
    w_gate, w_up, b_gate, b_up = gated_linear.unpack(w, bias, n)
    xq = q.double() * a_scale.double()[:, None]
    gate = xq @ w_gate.t() + (b_gate.double() if b_gate is not None else 0)
    up = xq @ w_up.t() + (b_up.double() if b_up is not None else 0)
    return (activation_ref(activation, gate) * up).to(x.dtype).reshape(*x.shape[:-1], n)


@torch.library.custom_op("accelc::gated_linear_fp8", mutates_args=())
def gated_linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                     n: int, activation: str = "silu", norm_weight: Optional[torch.Tensor] = None,
                     norm_eps: Optional[float] = None) -> torch.Tensor:
    """act(gate) * up with the gate and up weights in fp8 and x's rows quantized to fp8 (RMS-normalized first where
    norm_eps is given): see the module docstring."""
    return runtime.launch_or_fallback("gated_linear_fp8", x.device, gated_linear_fp8_launch, gated_linear_fp8_ref,
                                      x, w_q, w_scale, bias, n, activation, norm_weight, norm_eps)


@gated_linear_fp8.register_fake
def _(x, w_q, w_scale, bias, n, activation="silu", norm_weight=None, norm_eps=None):
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op("accelc::linear_fp8", mutates_args=())
def linear_fp8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
               residual: Optional[torch.Tensor] = None, activation: str = "none",
               residual_first: bool = False, norm_weight: Optional[torch.Tensor] = None,
               norm_eps: Optional[float] = None) -> torch.Tensor:
    """act((q @ w_q^T) * a_scale * w_scale + bias) (+ residual), x's rows quantized to fp8 (RMS-normalized first
    where norm_eps is given): see the module docstring."""
    return runtime.launch_or_fallback("linear_fp8", x.device, linear_fp8_launch, linear_fp8_ref, x, w_q, w_scale,
                                      bias, residual, activation, residual_first, norm_weight, norm_eps)


@linear_fp8.register_fake
def _(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False, norm_weight=None,
      norm_eps=None):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


__all__ = ["GATED_TUNER", "TUNER", "gated_linear_fp8", "gated_linear_fp8_launch", "gated_linear_fp8_ref", "linear_fp8", "linear_fp8_launch", "linear_fp8_ref", "quantize_rows", "quantize_rows_ref",
           "why_unsupported"]
