"""accelc::linear_w8a16 and accelc::gated_linear_w8a16 — int8 weights, float activations (weight-only int8).

For x (..., K) in fp16 / bf16 / fp32 and a weight quantized once at optimize time
(int8_gemm.quantize_weight: w_q (N, K) int8 and w_scale (N,) fp32, symmetric per output channel):

    out = act((x @ w_q^T) * w_scale + bias) (+ residual)          in x's dtype, fp32 accumulators

and the gated form of kernels/gated_linear.py (gate and up rows interleaved in one int8 weight, their
scales interleaved alike): act(gate) * up. The activations stay in the model's dtype: no per-token
quantization, so the error is the weight's alone. This is what pays in decoding, where a step reads
every weight once for a few rows and time is the weight's bytes: int8 halves them. The kernels are
accelc::linear's (kernels/gemm.py) with QUANT=3: the int8 weight tile converted to x's dtype in
registers (exact: |w_q| <= 127) before the tensor-core dot, or in gemv_kernel for a decode step's
rows, then the per-channel scale on the fp32 accumulators before the epilogue.
"""
from __future__ import annotations

from typing import Optional

import torch

from accelc import runtime
from accelc.kernels import gated_linear, gemm
from accelc.kernels.epilogue import activation_ref, epilogue_ref, residual_as
from accelc.kernels.int8_gemm import weight_problem
from accelc.tuning import Tuner, check_once

# own tuners: an int8 weight moves half the bytes of a float one, so its best tiles differ (and the
# tuning keys do not name the weight's dtype)
TUNER = Tuner("linear_w8a16", gemm.linear_kernel, gemm.CONFIGS, prune=gemm.prune_configs,
              default=gemm.default_config, interpreter=gemm.interpreter_config, other_kernels=gemm.other_kernels)
GATED_TUNER = Tuner("gated_linear_w8a16", gemm.linear_kernel, gemm.CONFIGS, prune=gemm.prune_configs,
                    default=gemm.default_config, interpreter=gemm.interpreter_config, other_kernels=gemm.other_kernels)
_CHECKED: set = set()


def why_unsupported(x, w_q, w_scale, bias=None, residual=None, activation="none", weight_dtype=torch.int8) -> str | None:
    """Why accelc::linear_w8a16 (weight_dtype int8) or accelc::linear_fp8w (float8_e4m3fn) cannot take these
    operands, or None (meta tensors are fine)."""
    problem = weight_problem(x, w_q, w_scale, weight_dtype)
    if problem:
        return problem
    if x.dtype not in gemm.SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not supported (fp16, bf16, fp32)"
    if w_q.device != x.device or w_scale.device != x.device:
        return f"w_q / w_scale are on {w_q.device} / {w_scale.device} but x is on {x.device}"
    return gemm.epilogue_problem(x, w_q.shape[0], bias, residual, activation)


def _check(x, w_q, w_scale, bias, residual, activation, what, weight_dtype, norm_weight=None, norm_eps=None):
    sig = (what, x.shape, x.dtype, x.device, w_q.shape, w_q.dtype, w_scale.shape, w_scale.dtype,
           None if bias is None else (bias.shape, bias.dtype), None if residual is None else residual.shape, activation,
           norm_eps is None)
    check_once(_CHECKED, sig, lambda: why_unsupported(x, w_q, w_scale, bias, residual, activation, weight_dtype)
               or gemm.norm_problem(x, norm_weight, norm_eps), what)


def linear_w8a16_launch(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False,
                        norm_weight=None, norm_eps=None):
    """Checks, allocates, launches. x (..., K), w_q (N, K) int8, w_scale (N,) -> (..., N) in x.dtype; norm_weight /
    norm_eps: x's rows RMS-normalized first (gemm.normed_rows)."""
    return weight_only_launch(x, w_q, w_scale, bias, residual, activation, residual_first, TUNER, "linear_w8a16",
                              norm_weight=norm_weight, norm_eps=norm_eps)


def weight_only_launch(x, w_q, w_scale, bias, residual, activation, residual_first, tuner, what,
                       weight_dtype=torch.int8, norm_weight=None, norm_eps=None):
    """linear_w8a16_launch with its tuner, name and weight dtype given: a one-byte weight, int8 or fp8 e4m3
    (kernels/fp8_weight.py)."""
    _check(x, w_q, w_scale, bias, residual, activation, what, weight_dtype, norm_weight, norm_eps)
    K, N = x.shape[-1], w_q.shape[0]
    residual = residual_as(residual, (*x.shape[:-1], N))
    x2 = x.reshape(-1, K)
    out = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and N > 0:
        res2 = residual.reshape(-1, N) if residual is not None else None
        x2, norm = gemm.normed_rows(x2, norm_weight, norm_eps)
        gemm.launch(x2, w_q, bias, res2, out, activation, residual_first, scales=(None, w_scale), tuner=tuner,
                    norm=norm)
    return out.reshape(*x.shape[:-1], N)


def dequantized(w_q, w_scale, dtype=torch.float32) -> torch.Tensor:
    return (w_q.to(torch.float32) * w_scale[:, None]).to(dtype)


def linear_w8a16_ref(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False,
                     norm_weight=None, norm_eps=None):
    """The same math in fp32 (fp64 for fp64 x): the dequantized weight (int8, or fp8: accelc::linear_fp8w's
    reference too), result in x's dtype."""
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    acc = gemm.rms_normed_ref(x, norm_weight, norm_eps, acc_dtype) @ dequantized(w_q, w_scale, acc_dtype).t()
    bias = bias.to(acc_dtype) if bias is not None else None
    residual = residual.to(acc_dtype) if residual is not None else None
    return epilogue_ref(acc, bias, residual, activation, residual_first).to(x.dtype)


def gated_linear_w8a16_launch(x, w_q, w_scale, bias, n, activation="silu", norm_weight=None, norm_eps=None):
    """Checks, allocates, launches. x (..., K), w_q (2 Np, K) int8 interleaved as gated_linear.pack
    makes it, w_scale (2 Np,), bias (2 Np,) or None -> act(gate) * up (..., n) in x's dtype."""
    return gated_weight_only_launch(x, w_q, w_scale, bias, n, activation, GATED_TUNER, "gated_linear_w8a16",
                                    norm_weight=norm_weight, norm_eps=norm_eps)


def gated_weight_only_launch(x, w_q, w_scale, bias, n, activation, tuner, what, weight_dtype=torch.int8,
                             norm_weight=None, norm_eps=None):
    """gated_linear_w8a16_launch with its tuner, name and weight dtype given (a one-byte weight, int8 or fp8)."""
    _check(x, w_q, w_scale, bias, None, activation, what, weight_dtype, norm_weight, norm_eps)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0 and n > 0:
        x2, norm = gemm.normed_rows(x2, norm_weight, norm_eps)
        gemm.launch(x2, w_q, bias, None, out, activation, False, scales=(None, w_scale), tuner=tuner, gated=True,
                    norm=norm)
    return out.reshape(*x.shape[:-1], n)


def gated_linear_w8a16_ref(x, w_q, w_scale, bias, n, activation="silu", norm_weight=None, norm_eps=None):
    w_gate, w_up, b_gate, b_up = gated_linear.unpack(dequantized(w_q, w_scale), bias, n)
    xf = gemm.rms_normed_ref(x, norm_weight, norm_eps, torch.float32)
    gate = xf @ w_gate.t() + (b_gate.float() if b_gate is not None else 0)
    up = xf @ w_up.t() + (b_up.float() if b_up is not None else 0)
    return (activation_ref(activation, gate) * up).to(x.dtype)


@torch.library.custom_op("accelc::linear_w8a16", mutates_args=())
def linear_w8a16(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 residual: Optional[torch.Tensor] = None, activation: str = "none",
                 residual_first: bool = False, norm_weight: Optional[torch.Tensor] = None,
                 norm_eps: Optional[float] = None) -> torch.Tensor:
    """act((x @ w_q^T) * w_scale + bias) (+ residual), x's rows first RMS-normalized where norm_eps is given: see
    the module docstring."""
    return runtime.launch_or_fallback("linear_w8a16", x.device, linear_w8a16_launch, linear_w8a16_ref, x, w_q,
                                      w_scale, bias, residual, activation, residual_first, norm_weight, norm_eps)


@linear_w8a16.register_fake
def _(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False, norm_weight=None,
      norm_eps=None):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


@torch.library.custom_op("accelc::gated_linear_w8a16", mutates_args=())
def gated_linear_w8a16(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                       n: int, activation: str = "silu", norm_weight: Optional[torch.Tensor] = None,
                       norm_eps: Optional[float] = None) -> torch.Tensor:
    """act(gate) * up with the gate and up weights int8 (x's rows first RMS-normalized where norm_eps is given):
    see the module docstring."""
    return runtime.launch_or_fallback("gated_linear_w8a16", x.device, gated_linear_w8a16_launch,
                                      gated_linear_w8a16_ref, x, w_q, w_scale, bias, n, activation, norm_weight,
                                      norm_eps)


@gated_linear_w8a16.register_fake
def _(x, w_q, w_scale, bias, n, activation="silu", norm_weight=None, norm_eps=None):
    return x.new_empty((*x.shape[:-1], n))


__all__ = ["GATED_TUNER", "TUNER", "dequantized", "gated_linear_w8a16", "gated_linear_w8a16_launch",
           "gated_linear_w8a16_ref", "gated_weight_only_launch", "linear_w8a16", "linear_w8a16_launch", "linear_w8a16_ref",
           "weight_only_launch", "why_unsupported"]
