"""accelc::linear_fp8w and accelc::gated_linear_fp8w — fp8 (e4m3) weights, float activations (weight-only fp8).

For x (..., K) in fp16 / bf16 / fp32 and a weight quantized once at optimize time (quantize_weight: w_q (N, K)
float8_e4m3fn and w_scale (N,) fp32, symmetric per output channel, the row's largest magnitude at e4m3's 448):

    out = act((x @ w_q^T) * w_scale + bias) (+ residual)          in x's dtype, fp32 accumulators

and the gated form (gate and up rows interleaved, kernels/gated_linear.py). The kernels are weight-only
int8's (kernels/int8_weight.py, accelc::linear's QUANT=3): the one-byte weight tile converted to x's dtype in
registers before the tensor-core dot, or in gemv_kernel for a decode step's rows, then the per-channel scale.
A decode step reads each weight once for a few rows, so the weight's bytes are its time: half of fp16's, as
int8's; e4m3 keeps 3 mantissa bits over a 2^-6..448 range where int8 keeps a uniform grid (the guard judges
each layer by SQNR against its float layer). Own tuners: the conversion differs from int8's.
"""
from __future__ import annotations

from typing import Optional

import torch

from accelc import runtime
from accelc.kernels import gemm
from accelc.kernels.int8_weight import gated_weight_only_launch, weight_only_launch
# the references are weight-only int8's: the dequantized weight (int8 or fp8 alike) in fp32 / fp64
from accelc.kernels.int8_weight import gated_linear_w8a16_ref as gated_linear_fp8w_ref
from accelc.kernels.int8_weight import linear_w8a16_ref as linear_fp8w_ref
from accelc.tuning import Tuner

DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
TUNER = Tuner("linear_fp8w", gemm.linear_kernel, gemm.CONFIGS, prune=gemm.prune_configs,
              default=gemm.default_config, interpreter=gemm.interpreter_config, other_kernels=gemm.other_kernels)
GATED_TUNER = Tuner("gated_linear_fp8w", gemm.linear_kernel, gemm.CONFIGS, prune=gemm.prune_configs,
                    default=gemm.default_config, interpreter=gemm.interpreter_config, other_kernels=gemm.other_kernels)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float weight -> (w_q (N, K) float8_e4m3fn, w_scale (N,) fp32): each row scaled so that its largest
    magnitude is e4m3's largest finite value, rounded to nearest (a row of zeros: scale 1, all zeros)."""
    w = weight.detach().float()
    amax = w.abs().amax(1)
    w_scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    w_q = (w / w_scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(DTYPE)
    return w_q.contiguous(), w_scale.contiguous()


def linear_fp8w_launch(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False,
                       norm_weight=None, norm_eps=None):
    """Checks, allocates, launches. x (..., K), w_q (N, K) float8_e4m3fn, w_scale (N,) -> (..., N) in x.dtype."""
    return weight_only_launch(x, w_q, w_scale, bias, residual, activation, residual_first, TUNER, "linear_fp8w",
                              DTYPE, norm_weight, norm_eps)


def gated_linear_fp8w_launch(x, w_q, w_scale, bias, n, activation="silu", norm_weight=None, norm_eps=None):
    """Checks, allocates, launches: act(gate) * up (..., n) in x's dtype, w_q (2 Np, K) float8_e4m3fn interleaved
    as gated_linear.pack makes it, w_scale (2 Np,)."""
    return gated_weight_only_launch(x, w_q, w_scale, bias, n, activation, GATED_TUNER, "gated_linear_fp8w", DTYPE,
                                    norm_weight, norm_eps)


@torch.library.custom_op("accelc::linear_fp8w", mutates_args=())
def linear_fp8w(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None, activation: str = "none",
                residual_first: bool = False, norm_weight: Optional[torch.Tensor] = None,
                norm_eps: Optional[float] = None) -> torch.Tensor:
    """act((x @ w_q^T) * w_scale + bias) (+ residual) with an fp8 weight, x's rows first RMS-normalized where
    norm_eps is given: see the module docstring."""
    return runtime.launch_or_fallback("linear_fp8w", x.device, linear_fp8w_launch, linear_fp8w_ref, x, w_q,
                                      w_scale, bias, residual, activation, residual_first, norm_weight, norm_eps)


@linear_fp8w.register_fake
def _(x, w_q, w_scale, bias=None, residual=None, activation="none", residual_first=False, norm_weight=None,
      norm_eps=None):
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


@torch.library.custom_op("accelc::gated_linear_fp8w", mutates_args=())
def gated_linear_fp8w(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                      n: int, activation: str = "silu", norm_weight: Optional[torch.Tensor] = None,
                      norm_eps: Optional[float] = None) -> torch.Tensor:
    """act(gate) * up with the gate and up weights in fp8 (x's rows first RMS-normalized where norm_eps is
    given): see the module docstring."""
    return runtime.launch_or_fallback("gated_linear_fp8w", x.device, gated_linear_fp8w_launch,
                                      gated_linear_fp8w_ref, x, w_q, w_scale, bias, n, activation, norm_weight,
                                      norm_eps)


@gated_linear_fp8w.register_fake
def _(x, w_q, w_scale, bias, n, activation="silu", norm_weight=None, norm_eps=None):
    return x.new_empty((*x.shape[:-1], n))


__all__ = ["DTYPE", "GATED_TUNER", "TUNER", "gated_linear_fp8w", "gated_linear_fp8w_launch", "gated_linear_fp8w_ref",
           "linear_fp8w", "linear_fp8w_launch", "linear_fp8w_ref", "quantize_weight"]
