"""accelc::linear_w8a8 — an int8 x int8 -> int32 GEMM with a dequantizing fused epilogue (W8A8).

For x (..., K) in fp16 / bf16 / fp32 and a weight quantized once at optimize time
(quantize_weight: w_q (N, K) int8 and w_scale (N,) fp32, symmetric per output channel):

    q, a_scale = quantize_per_token(x, smooth, static_scale)           kernels/quantize.py
    acc        = q @ w_q^T                                              int32, exact
    out        = act(acc * a_scale[:, None] * w_scale[None, :] + bias) (+ residual)   in x's dtype

With half outputs GELU is computed in its tanh form on the SFU's tanh (FAST_MATH in
kernels/epilogue.py).

The GEMM is accelc::linear's kernel (kernels/gemm.py, the persistent TMA / pointer tile loop and
the epilogue of kernels/epilogue.py) compiled with QUANT=1: int8 operands, an int32 accumulator
on the int8 tensor cores (twice fp16's peak on H100), and the two scales applied to the fp32
tile before bias / activation / residual. Only the candidates differ: an int8 tile of a given
size has half the bytes, so BLOCK_K doubles to 128 for the same shared memory per stage.

The weight stays int8 in memory (N * K bytes plus N fp32 scales instead of 2 * N * K).
"""
from __future__ import annotations

from typing import Optional

import torch

from accelc import runtime
from accelc.kernels import gemm
from accelc.kernels.epilogue import epilogue_ref, residual_as
from accelc.kernels.quantize import quantize_launch, quantize_ref
from accelc.kernels.quantize import why_unsupported as quantize_why_unsupported
from accelc.tuning import Tuner

_c = gemm.config
# int8 candidates: gemm.py's shapes with BLOCK_K doubled (same bytes per stage). From
# bench/gemm_sweep.py --int8 on an H200 (+ GELU, exact and FAST_MATH):
# - 128x128x256, 3 stages, TMA: 569 us at 4096x4096x16384 (491 us without the GELU: 1120 TOPS,
#   Inductor's best Triton int_mm 515 us), 21.4 us at 512x4096x4096; 128x256 tiles 673-686 us,
#   256x128 615 us, pointer loads 830-1190 us. GELU in the epilogue cost 83 us there (relu
#   none): the epilogue's math does not overlap the next tile's MMAs. With the FAST_MATH GELU
#   (kernels/epilogue.py): 256x128x128 473 us (1162 TOPS, GELU ~20 us of it), 128x128x256 527 us.
# - M <= 32: 16x32x512 pointer loads, 7.6 us at 16x4096x4096 (TMA 10.0 us).
CONFIGS = [
    _c(256, 128, 128, 3, 8), _c(128, 128, 256, 3, 8), _c(128, 128, 128, 4, 8), _c(64, 128, 128, 4, 4),
    _c(128, 128, 128, 4, 8, tma=False), _c(64, 128, 128, 4, 4, tma=False),
    _c(32, 64, 256, 4, 4, tma=False), _c(16, 32, 512, 3, 4, tma=False, flatten=False),
    _c(16, 64, 256, 4, 4),
]
# The warp-specialized Gluon kernel (kernels/gemm_hopper.py, sm90, half outputs) on int8 operands: the
# fp16 candidates' tiles at 128 deep (the same bytes a stage). On an H100 the race picks the ping-pong 128 x 128 at 4096 x 4096 x 16384, 395 us (1391 TOPS; the tl kernel's best
# was 482, 1141 TOPS) and the one-consumer 128 x 128 in 5 slots at 512 x 4096 x 4096 (16.0 us; tl 19.6).
GLUON_CONFIGS = [
    gemm.gluon_config(128, 256, 128, 3, 1, 8), gemm.gluon_config(256, 128, 128, 3, 1, 8),
    gemm.gluon_config(128, 128, 128, 4, 2, 4), gemm.gluon_config(128, 128, 128, 5, 1, 8),
]
CONFIGS += GLUON_CONFIGS

TUNER = Tuner("linear_w8a8", gemm.linear_kernel, CONFIGS, prune=gemm.prune_configs,
              default=gemm.default_config, interpreter=gemm.interpreter_config, other_kernels=gemm.other_kernels)


def _fail(message: str):
    raise ValueError(f"accelc::linear_w8a8: {message}")


def quantize_weight(weight: torch.Tensor, smooth: torch.Tensor | None = None):
    """(N, K) float weight -> (w_q (N, K) int8, w_scale (N,) fp32), symmetric per output channel.
    smooth: SmoothQuant's per-input-channel factor s (K,): the weight's columns are multiplied by
    s before quantizing (the activation is multiplied by 1 / s, kernels/quantize.py)."""
    w = weight.detach().float()
    if smooth is not None:
        w = w * smooth[None, :]
    amax = w.abs().amax(1)
    w_scale = amax / 127.0
    w_q = torch.round(w * (127.0 / amax.clamp_min(1e-30))[:, None]).clamp(-127, 127).to(torch.int8)
    return w_q.contiguous(), w_scale.contiguous()


def int8_gemm_launch(q, a_scale, w_q, w_scale, bias=None, residual=None, activation="none",
                     residual_first=False, out_dtype=torch.float16, raw=False):
    """q (M, K) int8, a_scale (M,) fp32, w_q (N, K) int8, w_scale (N,) fp32 -> (M, N) out_dtype,
    or with raw=True the (M, N) int32 accumulators q @ w_q^T (no scales, no epilogue)."""
    M, K = q.shape
    N = w_q.shape[0]
    if q.dtype != torch.int8 or w_q.dtype != torch.int8:
        _fail(f"operands must be int8, got {q.dtype} and {w_q.dtype}")
    if w_q.shape != (N, K):
        _fail(f"w_q must be (N, {K}), got {tuple(w_q.shape)}")
    if a_scale.shape != (M,) or w_scale.shape != (N,) or a_scale.dtype != torch.float32 \
            or w_scale.dtype != torch.float32:
        _fail(f"scales must be fp32 ({M},) and ({N},), got {tuple(a_scale.shape)} {a_scale.dtype} "
              f"and {tuple(w_scale.shape)} {w_scale.dtype}")
    out = torch.empty((M, N), dtype=torch.int32 if raw else out_dtype, device=q.device)
    if M > 0 and N > 0:
        if K == 0:
            return out.zero_() if raw else out.copy_(
                epilogue_ref(torch.zeros_like(out, dtype=torch.float32), bias, residual, activation,
                             residual_first))
        gemm.launch(q, w_q, bias, residual, out, activation, residual_first,
                    scales=(a_scale, w_scale), tuner=TUNER)
    return out


def weight_problem(x, w_q, w_scale, dtype=torch.int8) -> str | None:
    """What is wrong with a quantized weight (w_q (N, K) of `dtype`, w_scale (N,) fp32) for x (..., K), or None."""
    K = x.shape[-1] if x.dim() else -1
    if w_q.dim() != 2 or w_q.shape[1] != K:
        return f"x has K={K} features but w_q is {tuple(w_q.shape)}: expected (N, {K})"
    if w_q.dtype != dtype or w_scale.dtype != torch.float32 or tuple(w_scale.shape) != (w_q.shape[0],):
        return (f"w_q must be {str(dtype).removeprefix('torch.')} (N, K) and w_scale fp32 (N,), got {w_q.dtype} "
                f"{tuple(w_q.shape)} and {w_scale.dtype} {tuple(w_scale.shape)}")
    return None


def why_unsupported(x, w_q, w_scale, bias=None, residual=None, activation="none", smooth=None,
                    static_scale=None) -> str | None:
    """Why accelc::linear_w8a8 cannot take these operands, or None (meta tensors are fine)."""
    return (weight_problem(x, w_q, w_scale) or quantize_why_unsupported(x, smooth, static_scale)
            or gemm.epilogue_problem(x, w_q.shape[0], bias, residual, activation))


def linear_w8a8_launch(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False,
                       smooth=None, static_scale=None):
    """Checks, quantizes x, launches. x (..., K), w_q (N, K) int8, w_scale (N,), bias (N,),
    residual (..., N). Returns (..., N) in x.dtype."""
    reason = why_unsupported(x, w_q, w_scale, bias, residual, activation, smooth, static_scale)
    if reason is not None:
        _fail(reason)
    K, N = x.shape[-1], w_q.shape[0]
    out_shape = (*x.shape[:-1], N)
    q, a_scale = quantize_launch(x.reshape(-1, K), smooth, static_scale)
    residual = residual_as(residual, out_shape)
    res2 = residual.reshape(-1, N) if residual is not None else None
    out = int8_gemm_launch(q, a_scale, w_q, w_scale, bias, res2, activation, residual_first, x.dtype)
    return out.reshape(out_shape)


def int8_gemm_ref(q, a_scale, w_q, w_scale, bias=None, residual=None, activation="none",
                  residual_first=False, out_dtype=torch.float16, raw=False):
    """Integer reference: the products summed exactly (in fp64, exact for integers below 2^53:
    here |sum| <= 127^2 K), then the kernel's fp32 dequant."""
    acc = (q.double() @ w_q.double().t()).to(torch.int32)
    if raw:
        return acc
    acc = acc.float() * a_scale[:, None] * w_scale[None, :]
    if activation == "gelu" and out_dtype in (torch.float16, torch.bfloat16):
        activation = "gelu_tanh"   # the kernel's FAST_MATH epilogue (kernels/epilogue.py)
    return epilogue_ref(acc, bias, residual, activation, residual_first).to(out_dtype)


def linear_w8a8_ref(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False,
                    smooth=None, static_scale=None):
    K, N = x.shape[-1], w_q.shape[0]
    q, a_scale = quantize_ref(x.reshape(-1, K), smooth, static_scale)
    res2 = residual.reshape(-1, N) if residual is not None else None
    out = int8_gemm_ref(q, a_scale, w_q, w_scale, bias, res2, activation, residual_first, x.dtype)
    return out.reshape(*x.shape[:-1], N)


@torch.library.custom_op("accelc::linear_w8a8", mutates_args=())
def linear_w8a8(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None, activation: str = "none", residual_first: bool = False,
                smooth: Optional[torch.Tensor] = None, static_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """act(dequant(quant(x) @ w_q^T) + bias) (+ residual): see the module docstring."""
    return runtime.launch_or_fallback("linear_w8a8", x.device, linear_w8a8_launch, linear_w8a8_ref, x, w_q, w_scale,
                                      bias, residual, activation, residual_first, smooth, static_scale)


@linear_w8a8.register_fake
def _(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False, smooth=None,
      static_scale=None):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


__all__ = ["int8_gemm_launch", "int8_gemm_ref", "linear_w8a8", "linear_w8a8_launch", "linear_w8a8_ref",
           "quantize_weight", "weight_problem", "why_unsupported"]
