"""The fused epilogue shared by accelc's GEMM-shaped kernels (linear, conv2d).

After the fp32 accumulator tile is complete, in registers: + bias (per output channel),
activation, + residual — the residual either after the activation (transformer MLPs:
x + fc2(...)) or before it (ResNet blocks: relu(conv(x) + identity)). One store of the
result replaces the three or four memory round trips eager PyTorch makes.

Activations are a tl.constexpr code, so each variant compiles to straight-line code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from accelc import runtime

def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): the GELU approximation of CLIP (HF's QuickGELUActivation), which
    models write out; capture folds that written form into a call of this function."""
    return x * torch.sigmoid(1.702 * x)


# The activations the epilogue applies, one table for capture, rules and kernels:
# name -> (the PyTorch call capture writes it as, that call's keyword arguments). The position of a
# name in this table is the ACTIVATION constexpr code the kernels take.
ACTIVATIONS = {
    "none": (None, {}),
    "relu": (F.relu, {}),
    "gelu": (F.gelu, {}),
    "gelu_tanh": (F.gelu, {"approximate": "tanh"}),
    "silu": (F.silu, {}),
    "sigmoid": (torch.sigmoid, {}),
    "tanh": (torch.tanh, {}),
    "relu6": (F.relu6, {}),
    "hardswish": (F.hardswish, {}),
    "hardsigmoid": (F.hardsigmoid, {}),
    "quick_gelu": (quick_gelu, {}),
}
ACTIVATION_NAMES = tuple(ACTIVATIONS)


def activation_code(name: str) -> int:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATION_NAMES}, not {name!r}")
    return ACTIVATION_NAMES.index(name)


def activation_named(fn, kwargs: dict) -> str | None:
    """The ACTIVATIONS name of the call fn(x, **kwargs) (capture's canonical form), else None."""
    for name, (f, kw) in ACTIVATIONS.items():
        if f is not None and f is fn and kw == {k: v for k, v in kwargs.items() if v != "none"}:
            return name
    return None


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (1 + exp(2x)): exp overflow gives 1, underflow -1; no libdevice
    # call, so it also runs in the CPU interpreter. The division is the fast one (div.full.f32,
    # 2 ulp): the IEEE-rounded one's extra instructions showed in large GEMMs' epilogues, and
    # 2 ulp of fp32 is far under every output dtype's tolerance.
    return 1.0 - 2.0 * tl.fdiv(1.0, 1.0 + tl.exp(2.0 * x))


@triton.jit
def _sigmoid(x):
    # 1 / (1 + exp(-x)) as tl.sigmoid, with the fast division of _tanh
    return tl.fdiv(1.0, 1.0 + tl.exp(-x))


# libdevice and inline PTX exist on the GPU only; the CPU interpreter takes the portable branches.
_ON_GPU = tl.constexpr(not runtime.interpreted())


@triton.jit
def _fast_tanh(x):
    """The SFU's tanh.approx.f32 (one instruction, relative error < 2^-10.9) on the GPU."""
    if _ON_GPU:
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        y = _tanh(x)
    return y


@triton.jit
def _gelu(x, FIT: tl.constexpr):
    # On the GPU, exact GELU through libdevice's erf, as PyTorch computes it; in the interpreter,
    # and where FIT asks for it, the erfc fit below (same accuracy class, both within 1e-6 of fp64).
    # FIT: the warp-specialized Gluon GEMM (kernels/gemm_hopper.py), whose 4-warp consumers hold 128
    # accumulators a thread under a 168-register cap: libdevice's erf there spills 736 bytes a
    # thread (ptxas, sm_90a, triton 3.6), the branch-free fit nothing.
    if _ON_GPU and not FIT:
        y = 0.5 * x * (1.0 + libdevice.erf(x * 0.7071067811865476))
    else:
        # GELU(x) = x * Phi(x), Phi(x) = erfc(-x / sqrt(2)) / 2, with erfc from the Chebyshev fit
        # of Numerical Recipes' erfcc: fractional error < 1.2e-7 everywhere, branch-free, one exp
        # and one fast reciprocal. Against fp64 on [-12, 12]: max abs error 3.6e-7 (PyTorch's
        # fp32 GELU 8.9e-7).
        z = tl.abs(x) * 0.7071067811865476
        t = tl.fdiv(1.0, 1.0 + 0.5 * z)
        p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
            -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
                -0.82215223 + t * 0.17087277))))))))
        erfc = t * tl.exp(p - z * z)
        y = x * tl.where(x >= 0, 1.0 - 0.5 * erfc, 0.5 * erfc)
    return y


@triton.jit
def _relu6(x):
    # comparisons, not tl.minimum / tl.maximum: NaN stays NaN, as in eager
    return tl.where(x < 0.0, 0.0, tl.where(x > 6.0, 6.0, x))


@triton.jit
def apply_activation(x, ACTIVATION: tl.constexpr, FAST_MATH: tl.constexpr, GELU_FIT: tl.constexpr = False):
    """x: fp32 tile. ACTIVATION: code of an ACTIVATIONS name (activation_code). FAST_MATH (int8 layers with half
    outputs): both GELUs in the tanh form on the SFU's tanh. Against exact GELU that is 1.5e-4
    relative L2 (5e-4 at most per element), 60x under the int8 layer's own error (~41 dB), and it
    takes the epilogue from 83 to ~20 us at 4096x4096x16384 (bench/gemm_sweep.py --int8, H200);
    the exact epilogue does not overlap the tensor cores."""
    if ACTIVATION == 1:
        x = tl.where(x < 0.0, 0.0, x)   # not tl.maximum, which turns NaN into 0; eager's relu keeps NaN
    elif ACTIVATION == 2 and not FAST_MATH:
        x = _gelu(x, GELU_FIT)
    elif ACTIVATION == 2 or ACTIVATION == 3:
        if FAST_MATH:
            x = 0.5 * x * (1.0 + _fast_tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
        else:
            x = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif ACTIVATION == 4:
        x = x * _sigmoid(x)
    elif ACTIVATION == 5:
        x = _sigmoid(x)
    elif ACTIVATION == 6:
        x = _tanh(x)
    elif ACTIVATION == 7:
        x = _relu6(x)
    elif ACTIVATION == 8:
        x = x * _relu6(x + 3.0) / 6.0     # -inf * 0 = NaN, as eager's hardswish gives
    elif ACTIVATION == 9:
        x = _relu6(x + 3.0) / 6.0
    elif ACTIVATION == 10:
        x = x * _sigmoid(1.702 * x)
    return x


@triton.jit
def epilogue(acc, bias_ptr, res_ptrs, mask, offs_n, N,
             HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
             RESIDUAL_FIRST: tl.constexpr, ACTIVATION: tl.constexpr, FAST_MATH: tl.constexpr = False):
    """acc: fp32 [BLOCK_M, BLOCK_N] tile of output channels offs_n (< N valid); res_ptrs: the
    residual's [BLOCK_M, BLOCK_N] pointers (unused without HAS_RESIDUAL); mask: valid elements."""
    bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0) if HAS_BIAS else None
    res = tl.load(res_ptrs, mask=mask, other=0.0) if HAS_RESIDUAL else None
    return finish(acc, bias, res, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, FAST_MATH)


@triton.jit
def finish(acc, bias, res, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
           RESIDUAL_FIRST: tl.constexpr, ACTIVATION: tl.constexpr, FAST_MATH: tl.constexpr,
           GELU_FIT: tl.constexpr = False):
    """The epilogue's arithmetic on loaded operands: acc fp32 [BLOCK_M, BLOCK_N], bias [BLOCK_N],
    res [BLOCK_M, BLOCK_N] (either unused when its flag is off). The Gluon kernels
    (kernels/gemm_hopper.py), which load their operands their own way, call it as well."""
    if HAS_BIAS:
        acc += bias.to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        res = res.to(tl.float32)
        if RESIDUAL_FIRST:
            acc = apply_activation(acc + res, ACTIVATION, FAST_MATH, GELU_FIT)
        else:
            acc = apply_activation(acc, ACTIVATION, FAST_MATH, GELU_FIT) + res
    else:
        acc = apply_activation(acc, ACTIVATION, FAST_MATH, GELU_FIT)
    return acc


def activation_ref(name: str, x: torch.Tensor) -> torch.Tensor:
    """The PyTorch function each ACTIVATIONS entry stands for."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATION_NAMES}, not {name!r}")
    fn, kwargs = ACTIVATIONS[name]
    return x if fn is None else fn(x, **kwargs)


def epilogue_ref(acc, bias, residual, activation: str, residual_first: bool):
    """Reference of `epilogue` on an fp32 tensor whose last dim is the output channel."""
    if bias is not None:
        acc = acc + bias.float()
    if residual is not None and residual_first:
        return activation_ref(activation, acc + residual.float())
    acc = activation_ref(activation, acc)
    return acc + residual.float() if residual is not None else acc


def broadcasts_to(t, shape) -> bool:
    """Whether t broadcasts to `shape` as an eager add would take it (a residual of another batch
    or a bias-like row: (1, N), (N,) against (M, N))."""
    try:
        return torch.broadcast_shapes(tuple(t.shape), tuple(shape)) == tuple(shape)
    except RuntimeError:
        return False


def residual_as(residual, shape, **contiguous):
    """The residual at the output's shape: as it is, or broadcast and copied (a call whose residual
    broadcasts, as eager's add takes it; `contiguous`: the copy's memory format)."""
    if residual is None or tuple(residual.shape) == tuple(shape):
        return residual
    return residual.expand(shape).contiguous(**contiguous)
