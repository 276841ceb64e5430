"""accelc::gated_linear — a gated MLP's two input projections in one GEMM (SwiGLU, GeGLU, ReGLU).

For x (..., K), gate and up weights (N, K) as nn.Linear stores them, optional biases (N,):

    out = act(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up)

in x's dtype (fp16, bf16, fp32), both products accumulated in fp32 and the activation and the
product taken on the accumulators, rounded once. Eager PyTorch runs two GEMMs that each write an
(..., N) tensor, then an activation and a product that read them back (Inductor fuses the last
two, not the GEMMs). Here each x tile is loaded once for both products and only the result is
written: LlamaMLP's `act_fn(gate_proj(x)) * up_proj(x)`, T5 v1.1's gated-GELU.

The weights are packed once, at optimize time (pack): gate and up rows interleaved in blocks of
gemm.GATE_GROUP (16) rows, zero-padded to a multiple of it, as one (2 Np, K) matrix (biases the
same way). Then it is kernels/gemm.py's GEMM, main loop and configs unchanged, with its GATED
epilogue: every output tile holds whole gate / up block pairs, which it splits in registers and
writes as act(gate) * up, BLOCK_N / 2 columns. (A kernel with two accumulators and two weight
operands per tile, tried first, ran at 0.66x cuBLAS's one GEMM of the same FLOPs on the H100.)
"""
from __future__ import annotations

from typing import Optional

import torch
import triton

from accelc import runtime
from accelc.kernels import gemm
from accelc.kernels.epilogue import ACTIVATION_NAMES, ACTIVATIONS, activation_ref
from accelc.tuning import Tuner, check_once

SUPPORTED_DTYPES = gemm.SUPPORTED_DTYPES
G = gemm.GATE_GROUP

# gemm.py's candidates and its choice by M: the main loop is the same
TUNER = Tuner("gated_linear", gemm.linear_kernel, gemm.CONFIGS, prune=gemm.prune_configs,
              default=gemm.default_config, interpreter=gemm.interpreter_config, other_kernels=gemm.other_kernels)


def pack(w_gate: torch.Tensor, w_up: torch.Tensor, b_gate=None, b_up=None):
    """(N, K) gate and up weights (and (N,) biases, either may be None) -> the interleaved
    (2 Np, K) weight and (2 Np,) bias (None when both biases are): rows [g0..g15, u0..u15, g16..]."""
    N, K = w_gate.shape
    Np = triton.cdiv(N, G) * G

    def interleave(g, u):
        pad = (0, 0, 0, Np - N) if g.dim() == 2 else (0, Np - N)
        g, u = torch.nn.functional.pad(g, pad), torch.nn.functional.pad(u, pad)
        blocks = torch.stack([g.reshape(Np // G, G, *g.shape[1:]), u.reshape(Np // G, G, *u.shape[1:])], 1)
        return blocks.reshape(2 * Np, *g.shape[1:]).contiguous()
    w = interleave(w_gate, w_up)
    if b_gate is None and b_up is None:
        return w, None
    zeros = torch.zeros(N, dtype=w_gate.dtype, device=w_gate.device)
    return w, interleave(b_gate if b_gate is not None else zeros, b_up if b_up is not None else zeros)


def unpack(weight: torch.Tensor, bias, n: int):
    """pack's inverse: (w_gate, w_up, b_gate, b_up), biases None when bias is."""
    def split(t):
        blocks = t.reshape(t.shape[0] // (2 * G), 2, G, *t.shape[1:])
        return (blocks[:, 0].reshape(-1, *t.shape[1:])[:n], blocks[:, 1].reshape(-1, *t.shape[1:])[:n])
    wg, wu = split(weight)
    bg, bu = split(bias) if bias is not None else (None, None)
    return wg, wu, bg, bu


def why_unsupported(x, w_gate, w_up, b_gate=None, b_up=None, activation="silu") -> str | None:
    """Why a gated MLP with these (unpacked) operands cannot be taken, or None (meta tensors are fine)."""
    if x.dim() < 1:
        return "x must be at least 1-D (..., K)"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not supported (fp16, bf16, fp32)"
    K = x.shape[-1]
    for name, w in (("gate weight", w_gate), ("up weight", w_up)):
        if w.dim() != 2 or w.shape[1] != K:
            return f"the {name} must be (N, {K}) as nn.Linear stores it, got {tuple(w.shape)}"
        if w.dtype != x.dtype or w.device != x.device:
            return f"the {name} is {w.dtype} on {w.device} but x is {x.dtype} on {x.device}"
    N = w_gate.shape[0]
    if w_up.shape[0] != N:
        return f"gate and up projections differ in width ({N} vs {w_up.shape[0]})"
    for name, b in (("gate bias", b_gate), ("up bias", b_up)):
        if b is not None and (tuple(b.shape) != (N,) or b.dtype != x.dtype or b.device != x.device):
            return f"the {name} must be a ({N},) {x.dtype} vector on {x.device}, got {tuple(b.shape)} {b.dtype}"
    if activation not in ACTIVATIONS or activation == "none":
        return f"activation must be one of {ACTIVATION_NAMES[1:]}, not {activation!r}"
    return None


def packed_problem(weight, n: int, activation: str) -> str | None:
    """What is wrong with a packed weight (2 Np, K) for n output columns and a gated activation, whatever the
    weight's dtype (float, or one byte: kernels/fp8_gemm.py), or None."""
    if weight.dim() != 2 or weight.shape[0] != 2 * triton.cdiv(n, G) * G or n < 1:
        return (f"the packed weight must be (2 * {G} * ceil(n / {G}), K) for n={n} output columns, got "
                f"{tuple(weight.shape)} (kernels/gated_linear.pack)")
    if activation not in ACTIVATIONS or activation == "none":
        return f"activation must be one of {ACTIVATION_NAMES[1:]}, not {activation!r}"
    return None


def why_unsupported_packed(x, weight, bias, n: int, activation: str) -> str | None:
    """The op's own operands: a packed weight (2 Np, K) for n output columns."""
    problem = packed_problem(weight, n, activation)
    if problem:
        return problem
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return f"the packed bias must be ({weight.shape[0]},), got {tuple(bias.shape)}"
    half = weight[:n]        # stands for either half: same K, dtype and device
    return why_unsupported(x, half, half, bias[:n] if bias is not None else None, None, activation)


_CHECKED: set = set()


def gated_linear_launch(x, weight, bias, n, activation="silu", allow_tf32=False, norm_weight=None, norm_eps=None):
    """Checks, allocates, launches. x (..., K), packed weight / bias -> (..., n) in x's dtype; norm_weight /
    norm_eps: x's rows RMS-normalized first (gemm.normed_rows)."""
    sig = (x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device,
           None if bias is None else (bias.shape, bias.dtype, bias.device), n, activation, norm_eps is None)
    check_once(_CHECKED, sig, lambda: why_unsupported_packed(x, weight, bias, n, activation)
               or gemm.norm_problem(x, norm_weight, norm_eps), "gated_linear")
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] > 0:
        x2, norm = gemm.normed_rows(x2, norm_weight, norm_eps)
        gemm.launch(x2, weight, bias, None, out, activation, False, allow_tf32, tuner=TUNER, gated=True, norm=norm)
    return out.reshape(*x.shape[:-1], n)


def gated_linear_ref(x, weight, bias, n, activation="silu", allow_tf32=False, norm_weight=None, norm_eps=None):
    """Pure-PyTorch reference on the packed operands: fp32 (fp64 for fp64) math, result in x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    wg, wu, bg, bu = unpack(weight.to(acc), bias.to(acc) if bias is not None else None, n)
    xf = gemm.rms_normed_ref(x, norm_weight, norm_eps, acc)
    g = torch.nn.functional.linear(xf, wg, bg)
    u = torch.nn.functional.linear(xf, wu, bu)
    return (activation_ref(activation, g) * u).to(x.dtype)


@torch.library.custom_op("accelc::gated_linear", mutates_args=())
def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], n: int,
                 activation: str = "silu", allow_tf32: bool = False, norm_weight: Optional[torch.Tensor] = None,
                 norm_eps: Optional[float] = None) -> torch.Tensor:
    """act(x @ w_gate^T + b_gate) * (x @ w_up^T + b_up) on pack's operands, x's rows first RMS-normalized where
    norm_eps is given: see the module docstring."""
    reason = why_unsupported_packed(x, weight, bias, n, activation) or gemm.norm_problem(x, norm_weight, norm_eps)
    if reason is not None:
        raise ValueError(f"accelc::gated_linear: {reason}")
    return runtime.launch_or_fallback("gated_linear", x.device, gated_linear_launch, gated_linear_ref, x, weight,
                                      bias, n, activation, allow_tf32, norm_weight, norm_eps)


@gated_linear.register_fake
def _(x, weight, bias, n, activation="silu", allow_tf32=False, norm_weight=None, norm_eps=None):
    return x.new_empty((*x.shape[:-1], n))


__all__ = ["gated_linear", "gated_linear_launch", "gated_linear_ref", "pack", "packed_problem", "unpack",
           "why_unsupported"]
