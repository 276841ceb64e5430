"""Primitives the kernel families share: a tile's place in the grouped order (GEMM, conv, the Gluon GEMMs), the
GPU's SM count, what the copy engine (TMA) can load and a view of a tensor it can describe, and the steps of the
online softmax (flash attention, its decode split, the Gluon attention kernel)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (row block, column block), GROUP_M row blocks at a time so that the
    programs running together share weight tiles in L2 (tutorial 03's grouped ordering)."""
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (tile // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
    pid_n = (tile % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The SMs of CUDA device `index` (asked once)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def tma_ok(t: torch.Tensor) -> bool:
    """The copy engine needs a contiguous last dim and 16-byte aligned rows and base."""
    return (t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0
            and t.data_ptr() % 16 == 0 and t.shape[1] * t.element_size() >= 16)


def tma_view(t: torch.Tensor) -> torch.Tensor:
    """t with the strides of its size-1 dims replaced where they are not non-zero 16-byte
    multiples: PyTorch leaves those strides as they were (a 1x1 map keeps NCHW ones, a head sliced
    out keeps its projection's), they never address memory, but a TMA descriptor checks every
    stride. The replacement spans the whole tensor (as a contiguous layout's outer stride would),
    rounded up to 16 bytes. The attention and conv kernels' descriptors take their tensors
    through it."""
    fix = 16 // t.element_size()
    if all(n != 1 or st % fix == 0 and st > 0 for n, st in zip(t.shape, t.stride())):
        return t
    span = max(st * n for n, st in zip(t.shape, t.stride()) if n != 1) if t.numel() > 1 else 1
    span = -(-span // fix) * fix
    return t.as_strided(t.shape, [span if n == 1 else st for n, st in zip(t.shape, t.stride())])


@triton.jit
def log2_units(add):
    """An additive mask in log2 units: x log2(e), saturating at the largest finite float where
    that product overflows (bf16's and fp32's own minimum, the value HF's masks fill with, stays
    finite, as eager's softmax sees it: a row masked that way averages its values, not 0 or NaN);
    -inf stays -inf."""
    a = add.to(tl.float32)
    return tl.where(a == float("-inf"), a, tl.maximum(a * 1.4426950408889634, -3.4028234663852886e38))


@triton.jit
def softmax_update(acc, l_i, m_i, m_new, m_sub, p, v, DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """One key block's online-softmax step (base 2): the running sum and accumulator rescaled to
    the new row max (m_sub: it, or 0 where a row has seen no key), then p and p @ v added."""
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_IN_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def nonfinite_each(x):
    """1 where x is NaN or inf, else 0 (int32)."""
    return ((tl.abs(x) == float("inf")) | (x != x)).to(tl.int32)


@triton.jit
def nonfinite(x, AXIS: tl.constexpr):
    """1 where a slice of x along AXIS holds NaN or inf, else 0 (int32): its scale is then NaN (a max ignores NaN,
    and the clamp would make inf finite: the products stay NaN, as eager's)."""
    return tl.max(nonfinite_each(x), AXIS)


@triton.jit
def e4m3_scale(amax, bad):
    """A slice's e4m3 scale: its largest magnitude / 448 (e4m3's largest; 0 for zeros), NaN where bad."""
    return tl.where(bad > 0, float("nan"), tl.div_rn(amax, 448.0))


@triton.jit
def e4m3_inverse(amax):
    """What a slice is multiplied by before its conversion: 448 / its largest magnitude."""
    return tl.div_rn(448.0, tl.maximum(amax, 1e-30))


@triton.jit
def scaled_e4m3(x, inv, ROUND_BY_HAND: tl.constexpr):
    """x * inv (inv broadcast to x) clamped to e4m3's range and converted."""
    return to_e4m3(tl.minimum(tl.maximum(x * inv, -448.0), 448.0), ROUND_BY_HAND)


@triton.jit
def to_e4m3(y, ROUND_BY_HAND: tl.constexpr):
    """y (fp32, |y| <= 448) in e4m3, rounded to nearest even: the hardware's conversion on the GPU; in the
    interpreter, y first rounded to e4m3's grid in fp32 (3 mantissa bits: the step 2^(exponent - 3), 2^-9 under
    the smallest normal), since its own conversion loses a value that rounds up into the next binade (124.3 ->
    64, not 128)."""
    if ROUND_BY_HAND:
        step = tl.exp2(tl.floor(tl.log2(tl.maximum(tl.abs(y), 0.015625))) - 3.0)
        y = ((y / step + 12582912.0) - 12582912.0) * step
    return y.to(tl.float8e4nv)
