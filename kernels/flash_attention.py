"""accelc::flash_attention — softmax(q @ k^T * scale + mask) @ v without the L x S matrix.

q (B, H, L, D), k (B, Hkv, S, D), v (B, Hkv, S, D), any strides (so the transposes that split heads
cost no copy), fp16 or bf16, or fp32 (true fp32 products, or TF32 tensor cores with allow_tf32: the
fp32_precision a config asks; pointer loads, smaller tiles), D a multiple of 8 from 16 to 256 (run padded to the next power of
two). Grouped-query attention natively: H a multiple of Hkv, query head h reads K/V head
h // (H / Hkv), as F.scaled_dot_product_attention(enable_gqa=True); no repeated K/V is made. Optional mask
broadcastable to (B, H, L, S): additive float (same dtype as q) or boolean (True = attend).
is_causal: query i attends keys j <= i (top-left aligned, as F.scaled_dot_product_attention).
scale defaults to 1/sqrt(D). Out (B, H, L, D) in q's dtype, laid out in memory as (B, L, H, D):
the usual next step, out.transpose(1, 2).reshape(B, L, H * D), is then a view, not a copy. A
query row whose keys are all masked gives zeros, as F.scaled_dot_product_attention does (HF's
padding masks make such rows: a left-padded causal row), or NaN with empty_nan=True, as a
written-out softmax(...) @ v does; NaN in q, k or v still gives NaN.

FlashAttention (Dao et al. 2022), forward as Triton's tutorial 06-fused-attention: one program
per BLOCK_M query rows of one (batch, head); keys and values streamed in BLOCK_N blocks; the
running row max m_i and sum l_i rescale the fp32 accumulator (online softmax, in base 2).
Key blocks fully left of the causal diagonal and fully inside S run without any masking; only
the diagonal and the ragged tail apply the causal and bounds masks. Where the strides allow
(qkv_tma_ok), TMA configs load q, K and V as (1, 1, rows, BLOCK_D) boxes of 4-D descriptors over the
tensors' own strides. Without a mask the softmax scale folds into one fma with the row max; a
mask broadcast over query rows (a key padding mask) is read as one row per key block.

qk_int8=True (Int8Config.attention): q and k are quantized per token to int8 in registers, as
they are loaded (symmetric, absmax over the head dim, the rounding of kernels/quantize.py), and
q @ k^T runs on the int8 tensor cores with an int32 accumulator, dequantized by the two row
scales (the softmax scale folded into q's). Softmax and p @ v stay in fp32 / fp16 / bf16.

fp8=True (Fp8Config(attention=True); fp16 / bf16 inputs, head dims in multiples of 32): both products on e4m3
operands with fp32 accumulators, as FlashAttention-3's fp8 forward: q, K and V quantized once before the kernel
(kernels/attention_fp8.py: q and K a token at a time, V a head-dim column at a time over its keys, stored with the
keys contiguous), the kernel reading the e4m3 copies by pointer loads; q's row scales fold into the softmax scale,
K's multiply q @ K^T's columns, V's the output's columns once at the end; p (in [0, 1]) scaled by 448, the row
sums from the unquantized p. About 27-28 dB SQNR against the exact attention on random inputs. On sm90 the Gluon
kernel's two-warpgroup candidates take the same copies by TMA (kernels/attention_hopper.py, FP8) and race the tl
ones.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from accelc import runtime
from accelc.kernels import attention_fp8, flash_decoding
from accelc.kernels.flash_decoding import LOG2E, softmax_scale
from accelc.kernels.primitives import log2_units, softmax_update, tma_view, to_e4m3
from accelc.kernels.quantize import quantize_ref, rint
from accelc.tuning import CompiledCall, Tuner, check_once
from accelc.compile_ahead import launch_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GRID_Y = 65535   # CUDA's limit on a grid's second dimension, which runs over batch x heads
HEAD_DIMS = tuple(range(16, 257, 8))   # multiples of 8, 16 to 256


@triton.jit
def _attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, ks_base, b, hk, mask_base, offs_m, offs_d, lo, hi,
                 L, S,
                 stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASK_KIND: tl.constexpr, MASK_ROW: tl.constexpr, CAUSAL: tl.constexpr, CHECK_BOUNDS: tl.constexpr,
                 FMA_SOFTMAX: tl.constexpr, TMA: tl.constexpr,
                 DOT_IN_FP32: tl.constexpr, QK_INT8: tl.constexpr, USE_LIBDEVICE: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, FP8: tl.constexpr):
    """Key blocks [lo, hi): online-softmax update of (acc, l_i, m_i). With QK_INT8, q is the
    int8 tile and qk_scale the (BLOCK_M,) vector of its row scales x softmax scale; with FP8 likewise in e4m3,
    K and V e4m3 too (V's keys contiguous), ks_base K's scale a key. With TMA the
    K / V blocks are (1, 1, BLOCK_N, BLOCK_D) boxes of the (B, Hkv, S, D) tensors, the copy engine
    zero-filling rows past S and columns past D; else pointer loads, masked the same way."""
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < L     # the mask is read only at real query rows: the last block's extra rows are past its end
    # no mask, no causal or bounds mask in these blocks, a scale >= 0: the scale multiplies the
    # row max (max(s * x) = s * max(x) for s >= 0) and then folds into one fma with the max's
    # subtraction, one float op an element fewer in the softmax
    PLAIN: tl.constexpr = (FMA_SOFTMAX and MASK_KIND == 0 and not CAUSAL and not CHECK_BOUNDS and not QK_INT8
                           and not FP8)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < S
        if TMA:
            kt = tl.reshape(k_desc.load([b, hk, start_n, 0]), [BLOCK_N, BLOCK_D]).T   # (BLOCK_D, BLOCK_N)
            v = tl.reshape(v_desc.load([b, hk, start_n, 0]), [BLOCK_N, BLOCK_D])
        elif CHECK_BOUNDS:
            kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                         mask=d_ok[:, None] & n_ok[None, :], other=0.0)           # (BLOCK_D, BLOCK_N)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)            # (BLOCK_N, BLOCK_D)
        else:   # whole blocks below S: no key mask (one along fp8 V's contiguous keys keeps its load from the
            #     asynchronous copies that pipeline the loop: bytes masked one by one)
            kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                         mask=d_ok[:, None], other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=d_ok[None, :], other=0.0)
        if QK_INT8:
            k_amax = tl.max(tl.abs(kt.to(tl.float32)), 0)                      # (BLOCK_N,)
            k_inv = tl.div_rn(127.0, tl.maximum(k_amax, 1e-30))
            kt8 = rint(kt.to(tl.float32) * k_inv[None, :], USE_LIBDEVICE).to(tl.int8)
            k_scale = tl.div_rn(k_amax, 127.0)
            qk = tl.dot(q, kt8, out_dtype=tl.int32).to(tl.float32) * qk_scale[:, None] * k_scale[None, :]
        elif FP8:
            k_scale = tl.load(ks_base + offs_n, mask=n_ok, other=0.0) if CHECK_BOUNDS else tl.load(ks_base + offs_n)
            qk = tl.dot(q, kt, out_dtype=tl.float32) * qk_scale[:, None] * k_scale[None, :]
        elif DOT_IN_FP32:
            qk = tl.dot(q.to(tl.float32), kt.to(tl.float32))
        else:
            qk = tl.dot(q, kt, input_precision=INPUT_PRECISION)
        if PLAIN:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            # a row with no visible key so far keeps m = -inf: subtract 0 instead (p = 0, no NaN)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        else:
            if not QK_INT8 and not FP8:
                qk = qk * qk_scale                          # log2 units: exp2 below
            if MASK_KIND == 1:   # additive float mask, natural-log units
                if MASK_ROW:     # the same for every query row (a key padding mask): one row read
                    add = tl.load(mask_base + offs_n * stride_mn, mask=n_ok, other=0.0)
                    qk += log2_units(add)[None, :]
                else:
                    add = tl.load(mask_base + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn,
                                  mask=m_ok[:, None] & n_ok[None, :], other=0.0)
                    qk += log2_units(add)
            elif MASK_KIND == 2:  # boolean mask: True attends
                if MASK_ROW:
                    keep = tl.load(mask_base + offs_n * stride_mn, mask=n_ok, other=0)
                    qk = tl.where(keep[None, :] != 0, qk, float("-inf"))
                else:
                    keep = tl.load(mask_base + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn,
                                   mask=m_ok[:, None] & n_ok[None, :], other=0)
                    qk = tl.where(keep != 0, qk, float("-inf"))
            if CAUSAL:
                qk = tl.where(offs_m[:, None] >= offs_n[None, :], qk, float("-inf"))
            if CHECK_BOUNDS:
                qk = tl.where(n_ok[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_sub[:, None])
        if FP8:
            acc, l_i, m_i = _pv_fp8(acc, l_i, m_i, m_new, m_sub, p, v, USE_LIBDEVICE)
        else:
            acc, l_i, m_i = softmax_update(acc, l_i, m_i, m_new, m_sub, p, v, DOT_IN_FP32, INPUT_PRECISION)
    return acc, l_i, m_i


@triton.jit
def _pv_fp8(acc, l_i, m_i, m_new, m_sub, p, v, USE_LIBDEVICE: tl.constexpr):
    """softmax_update with p @ V on e4m3 operands: p (in [0, 1]) scaled by 448 (the kernel's end divides it out
    with V's column scales); the sum l_i of the unquantized p, as FlashAttention-3's fp8 forward keeps it."""
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    p8 = to_e4m3(p * 448.0, not USE_LIBDEVICE)
    acc = acc * alpha[:, None] + tl.dot(p8, v, out_dtype=tl.float32)
    return acc, l_i, m_new


# the lengths, and the mask strides that follow them (a row of S keys): one binary for every length
@triton.jit(do_not_specialize=["L", "S"], do_not_specialize_on_alignment=["stride_mb", "stride_mh", "stride_mm"])
def _flash_fwd_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr,
    # with FP8: q's scale a row (B, H, L), K's a key (B, Hkv, S), V's a head-dim column (B, Hkv, D), fp32
    qs_ptr, ks_ptr, vs_ptr,
    # TMA descriptors of q, k, v as (B, H, L, D) / (B, Hkv, S, D) with (1, 1, rows, BLOCK_D) boxes
    # (placeholders unless TMA)
    q_desc, k_desc, v_desc,
    # sizes (GROUP = H / Hkv query heads share a K/V head)
    H, GROUP, L, S, qk_scale,
    # strides (batch, head, row, dim); mask strides are 0 along broadcast dims
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    # meta-parameters
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_KIND: tl.constexpr, MASK_ROW: tl.constexpr,
    IS_CAUSAL: tl.constexpr, FMA_SOFTMAX: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, QK_INT8: tl.constexpr, USE_LIBDEVICE: tl.constexpr, EMPTY_NAN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
    FP8: tl.constexpr = False,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < L
    if TMA:
        q = tl.reshape(q_desc.load([b, h, start_m * BLOCK_M, 0]), [BLOCK_M, BLOCK_D])
    else:
        q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if QK_INT8:
        q_amax = tl.max(tl.abs(q.to(tl.float32)), 1)                           # (BLOCK_M,)
        q = rint(q.to(tl.float32) * tl.div_rn(127.0, tl.maximum(q_amax, 1e-30))[:, None],
                  USE_LIBDEVICE).to(tl.int8)
        qk_scale = tl.div_rn(q_amax, 127.0) * qk_scale
    HKV = H // GROUP
    if FP8:
        qk_scale = tl.load(qs_ptr + bh * L + offs_m, mask=m_ok, other=0.0) * qk_scale   # a scale a query row
    k_base = k_ptr + b * stride_kb + (h // GROUP) * stride_kh
    v_base = v_ptr + b * stride_vb + (h // GROUP) * stride_vh
    mask_base = mask_ptr + b * stride_mb + h * stride_mh
    ks_base = ks_ptr + (b * HKV + h // GROUP) * S

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    # keys every query row of this block may see, in whole blocks: no causal or bounds mask
    end = tl.minimum(start_m * BLOCK_M, S) if IS_CAUSAL else S
    full = (end // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, ks_base, b, h // GROUP, mask_base,
                                 offs_m, offs_d, 0, full, L, S,
                                 stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn, qk_scale,
                                 HEAD_DIM, BLOCK_D, BLOCK_N, MASK_KIND, MASK_ROW, False, False, FMA_SOFTMAX, TMA,
                                 DOT_IN_FP32, QK_INT8, USE_LIBDEVICE, INPUT_PRECISION, FP8)
    # the rest: the causal diagonal and the ragged end of S
    tail_end = tl.minimum((start_m + 1) * BLOCK_M, S) if IS_CAUSAL else S
    acc, l_i, m_i = _attn_blocks(acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, ks_base, b, h // GROUP, mask_base,
                                 offs_m, offs_d, full, tail_end, L, S,
                                 stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn, qk_scale,
                                 HEAD_DIM, BLOCK_D, BLOCK_N, MASK_KIND, MASK_ROW, IS_CAUSAL, True, FMA_SOFTMAX, TMA,
                                 DOT_IN_FP32, QK_INT8, USE_LIBDEVICE, INPUT_PRECISION, FP8)

    if FP8:   # V's column scales, p's 448 out
        acc = acc * (tl.load(vs_ptr + (b * HKV + h // GROUP) * HEAD_DIM + offs_d, mask=offs_d < HEAD_DIM,
                             other=0.0) * (1.0 / 448.0))[None, :]
    # a row with no visible key (l_i == 0, acc == 0) gives 0, as SDPA does, or NaN (0 / 0) as a
    # written-out softmax does (EMPTY_NAN); a NaN l_i stays NaN
    if EMPTY_NAN:
        out = acc / l_i[:, None]
    else:
        out = tl.where(l_i[:, None] == 0.0, 0.0, acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None])   # no 0 / 0 computed
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


def config(bm, bn, stages, warps, tma=False) -> triton.Config:
    """tma: q, K and V blocks loaded as TMA boxes (qkv_tma_ok inputs, head dims up to 128)."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "TMA": tma}, num_stages=stages, num_warps=warps)


# H100 candidates, tutorial 06's forward space: 128 query rows a program (64 for short L),
# 64 or 128 keys a step, by pointer loads or (where the strides allow) TMA boxes
# head dims over 128 (a 256-wide fp32 accumulator, K/V tiles twice as large): fewer rows, 2 stages
CONFIGS = [config(128, 64, 3, 8), config(128, 128, 3, 8), config(128, 64, 4, 4), config(128, 32, 4, 4),
           config(64, 64, 4, 4), config(64, 32, 2, 4), config(64, 64, 2, 8),
           config(128, 64, 3, 8, tma=True), config(128, 128, 3, 8, tma=True), config(128, 128, 2, 8, tma=True),
           config(128, 64, 4, 4, tma=True), config(64, 64, 4, 4, tma=True)]
_WIDE = [config(64, 32, 2, 4), config(64, 64, 2, 8)]
# fp32 (twice the bytes a tile): fewer rows and keys a step, two stages, pointer loads
_FP32 = [config(64, 32, 2, 4), config(64, 64, 2, 4), config(32, 32, 2, 4), config(128, 32, 2, 8)]
CONFIGS += [c for c in _FP32 if c not in CONFIGS]


def gluon_config(block_n, stages, pingpong=True, consumers=2) -> triton.Config:
    """A candidate of the warp-specialized Gluon kernel (kernels/attention_hopper.py, sm90 only):
    `consumers` softmax warpgroups of 64 query rows, block_n keys a step, a ring of `stages` K / V
    slots, the warpgroups issuing their MMAs in turns (pingpong, FA3's scheduler barrier) or as they
    come. Two consumers and the load warpgroup (12 warps) hold the SM's registers at 168 a thread
    (maxnreg), moved at launch to the softmax warpgroups (232) from the load one (40); three (16
    warps) at 128, moved to 160 and 24."""
    three = consumers == 3
    return triton.Config({"BLOCK_M": 64 * consumers, "BLOCK_N": block_n, "TMA": True, "GLUON": True, "STAGES": stages,
                          "PINGPONG": pingpong, "CONSUMERS": consumers,
                          "SOFTMAX_REGS": 160 if three else 232, "LOAD_REGS": 24 if three else 40},
                         num_warps=4, num_stages=1, maxnreg=128 if three else 168)


# On an H100: two consumers, 128 keys a step, a
# three-slot ring: 620 TF/s at 4 x 16 x 4096 x 128 (cuDNN 655); three consumers (192 rows, head
# dims <= 64): 499 TF/s at 4 x 16 x 4096 x 64 (cuDNN 476); 64 keys, four slots: BERT's 8 x 384 with
# its mask. Dropped after the first runs (never the fastest): two-slot rings with turns, 64 keys
# with three slots, each block's MMAs issued alone (within 1-10% behind).
GLUON_CONFIGS = [gluon_config(128, 3), gluon_config(128, 3, False), gluon_config(128, 2, False),
                 gluon_config(64, 4, False), gluon_config(128, 2, False, 3), gluon_config(64, 3, False, 3),
                 gluon_config(128, 3, True, 3)]
CONFIGS += GLUON_CONFIGS


def _prune(configs, sizes):
    if sizes.get("fp32"):
        return [c for c in _FP32 if sizes["D"] <= 128 or c.kwargs["BLOCK_M"] <= 64 and c.kwargs["BLOCK_N"] <= 32]
    if sizes["D"] > 128:
        return [c for c in configs if c in _WIDE]
    keep = [c for c in configs if c not in _WIDE and c not in _FP32 and not c.kwargs.get("GLUON")
            and (sizes["tma"] or not c.kwargs["TMA"])]
    if sizes.get("gluon"):
        # three softmax warpgroups (head dims <= 64) in 128 registers a thread: fp8's scales and e4m3 p spill there
        keep += [c for c in configs if c.kwargs.get("GLUON")
                 and (c.kwargs["CONSUMERS"] == 2 or sizes["D"] <= 64 and not sizes.get("fp8"))
                 and _hopper().smem_bytes(c.kwargs["BLOCK_N"], sizes["D"], c.kwargs["STAGES"], c.kwargs["CONSUMERS"],
                                          1 if sizes.get("fp8") else 2) <= 227 * 1024]
    return keep


def qkv_tma_ok(*tensors) -> bool:
    """Whether q, k, v (4-D) can be read as TMA boxes: head dim contiguous, every other stride a
    non-zero multiple of 16 bytes (an expanded head dim is not), 16-byte aligned data."""
    for t in tensors:
        t = tma_view(t)
        size = t.element_size()
        if t.stride(3) != 1 or t.data_ptr() % 16 or any(st <= 0 or st * size % 16 for st in t.stride()[:3]):
            return False
    return True


def _default(sizes):
    if sizes["D"] > 128 or sizes.get("fp32"):
        return config(64, 32, 2, 4)
    return config(128, 64, 3, 8) if sizes["L"] >= 128 else config(64, 64, 3, 4)


# (kernels.attention_hopper, None), or (None, why this Triton cannot build it)
_hopper_import = functools.partial(runtime.import_gluon, "attention_hopper", "attention kernel", "flash_attention")


def _hopper():
    return _hopper_import()[0]


def gluon_problem(q, k, v, qk_int8=False, fp8=False) -> str | None:
    """Why the warp-specialized Gluon kernel (kernels/attention_hopper.py) cannot take this call, or None. fp8: it
    reads the e4m3 copies (kernels/attention_fp8.py), laid out for the copy engine whatever q, k, v's strides."""
    problem = runtime.gluon_target_problem(q, "attention kernel")
    if problem:
        return problem
    if qk_int8:
        return "the Gluon attention kernel has no int8 q @ k^T"
    module, reason = _hopper_import()
    if module is None:
        return reason
    if q.shape[3] not in module.HEAD_DIMS:
        return f"head dim {q.shape[3]} (the Gluon kernel takes {', '.join(map(str, module.HEAD_DIMS))})"
    if k.shape[2] == 0:
        return "no keys"
    if not fp8 and not qkv_tma_ok(q, k, v):
        return "q, k or v rows are not 16-byte aligned for the copy engine"
    return None


def _other_kernels() -> list:
    module = _hopper()
    return [module.attention_ws_kernel] if module else []


def _interpreter_config(sizes):
    # small blocks, so that the CPU tests' short sequences (up to 64 keys) still span several key
    # blocks; a long one (a generation test's cache, 96 keys) in blocks of up to 128: the
    # interpreter's time goes by the loop's steps, not by the block's size
    return config(16, min(128, triton.next_power_of_2(sizes["S"])) if sizes["S"] > 64 else 16, 1, 4)


TUNER = Tuner("flash_attention", _flash_fwd_kernel, CONFIGS, prune=_prune, default=_default,
              interpreter=_interpreter_config, other_kernels=_other_kernels, size_fields=2)


def why_unsupported(q, k, v, mask=None) -> Optional[str]:
    """Why accelc::flash_attention cannot take these inputs (the caller then stays PyTorch)."""
    if q.dim() == k.dim() == v.dim() == 3:     # (batch * heads, length, head_dim): attention written with bmm
        return why_unsupported(q[None], k[None], v[None], mask)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-D (batch, heads, length, head_dim) or all 3-D (batch * heads, length, head_dim)"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (the kernel takes fp16, bf16 and fp32)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "q, k, v dtypes differ"
    B, H, L, D = q.shape
    Hkv = k.shape[1]
    if k.shape[0] != B or v.shape[:2] != k.shape[:2] or k.shape[2] != v.shape[2] or Hkv == 0 or H % Hkv:
        return (f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match (k and v alike, "
                "query heads a multiple of key/value heads)")
    if k.shape[3] != D or v.shape[3] != D:
        return f"head dims differ: q/k {D}, v {v.shape[3]}"
    if D not in HEAD_DIMS:
        return f"head dim {D} (the kernel takes multiples of 8 from 16 to 256)"
    if mask is not None:
        if mask.dtype != torch.bool and mask.dtype != q.dtype:
            return f"mask dtype {mask.dtype} (bool, or q's dtype {q.dtype})"
        try:
            torch.broadcast_shapes(mask.shape, (B, H, L, k.shape[2]))
        except RuntimeError:
            return f"mask {tuple(mask.shape)} does not broadcast to {(B, H, L, k.shape[2])}"
        if mask.dim() > 4:
            return "mask has more than 4 dims"
    if not (q.device == k.device == v.device and (mask is None or mask.device == q.device)):
        return "tensors on different devices"
    return None


def fp8_problem(q, qk_int8=False) -> str | None:
    """Why q, k and v cannot run in e4m3 (fp8=True), or None: half inputs, a head dim the fp8 products take."""
    if qk_int8:
        return "fp8 and qk_int8 together"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"fp8 attention takes fp16 / bf16 inputs, not {q.dtype}"
    if q.shape[-1] % 32:
        return f"head dim {q.shape[-1]}: fp8 attention takes multiples of 32"
    return None


_CHECKED: set = set()   # call signatures whose operands why_unsupported accepted


def flash_attention_launch(q, k, v, mask=None, is_causal=False, scale=None, qk_int8=False, empty_nan=False,
                           allow_tf32=False, fp8=False):
    """Checks, allocates, launches. A call signature seen before launches its compiled kernel
    directly (accelc.tuning.CompiledCall). 3-D q, k, v (batch * heads, length, head_dim) run as
    one batch of that many heads, into a contiguous (batch * heads, length, head_dim) result, as
    torch.bmm gives it."""
    out = _empty_out(q)
    if q.dim() == k.dim() == v.dim() == 3:
        _launch(q[None], k[None], v[None], mask, is_causal, scale, qk_int8, empty_nan, out[None], allow_tf32, fp8)
    else:
        _launch(q, k, v, mask, is_causal, scale, qk_int8, empty_nan, out, allow_tf32, fp8)
    return out


def _launch(q, k, v, mask, is_causal, scale, qk_int8, empty_nan, out, allow_tf32=False, fp8=False):
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    fp32 = q.dtype == torch.float32
    tf32 = bool(allow_tf32) and fp32
    sig = (tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for t in tensors),
           bool(is_causal), scale, bool(qk_int8), bool(empty_nan), tf32, bool(fp8))
    check_once(_CHECKED, sig, lambda: why_unsupported(q, k, v, mask) or (fp8_problem(q, qk_int8) if fp8 else None),
               "flash_attention")
    B, H, L, D = q.shape
    S = k.shape[2]
    if out.numel() == 0:
        return
    if B * H > MAX_GRID_Y:
        _launch_in_slices(q, k, v, mask, is_causal, scale, qk_int8, empty_nan, out, allow_tf32, fp8)
        return
    mask_t = q if mask is None else mask.expand(B, H, L, S)  # a view: broadcast dims get stride 0
    with runtime.device_guard(q):
        fp8_ops = _fp8_operands(q, k, v) if fp8 else None
        known = TUNER.calls.get(sig)
        if known is not None:
            call, kw = known
            call(_args(kw, q, k, v, mask_t, out, mask is not None, scale, fp8_ops), q.device.index or 0)
            return
        if flash_decoding.takes(q, k, is_causal, qk_int8 or fp8):    # a decode step: split over the keys
            flash_decoding.launch(q, k, v, mask_t, mask is not None, softmax_scale(q, scale) * LOG2E,
                                  empty_nan, out)
            return
        # fp8: pointer loads of the e4m3 copies
        use_tma = D <= 128 and not fp32 and not fp8 and qkv_tma_ok(q, k, v)
        gluon = (use_tma or fp8) and gluon_problem(q, k, v, qk_int8, fp8) is None
        meta = dict(HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
                    MASK_KIND=0 if mask is None else 2 if mask.dtype == torch.bool else 1,
                    MASK_ROW=mask is not None and mask_t.stride(2) == 0,
                    IS_CAUSAL=bool(is_causal), FMA_SOFTMAX=softmax_scale(q, scale) >= 0, DOT_IN_FP32=flash_decoding.dot_in_fp32(q),
                    QK_INT8=bool(qk_int8), USE_LIBDEVICE=not runtime.interpreted(), EMPTY_NAN=bool(empty_nan),
                    INPUT_PRECISION="tf32" if tf32 else "ieee", FP8=bool(fp8))

        def plan(kw):
            """(kernel, its constexprs and launch options) for a config's kwargs."""
            if kw.get("GLUON"):
                return _hopper().attention_ws_kernel, dict(
                    MASK_KIND=meta["MASK_KIND"], MASK_ROW=meta["MASK_ROW"], IS_CAUSAL=meta["IS_CAUSAL"],
                    EMPTY_NAN=meta["EMPTY_NAN"], STAGES=kw["STAGES"], PINGPONG=kw["PINGPONG"],
                    FOLD=meta["MASK_KIND"] == 0 and softmax_scale(q, scale) > 0 and not fp8,
                    CONSUMERS=kw["CONSUMERS"], SOFTMAX_REGS=kw["SOFTMAX_REGS"], LOAD_REGS=kw["LOAD_REGS"],
                    FP8=bool(fp8), num_warps=kw["num_warps"], maxnreg=kw["maxnreg"])
            return _flash_fwd_kernel, dict(meta, **kw)

        def run(cfg):
            kw = cfg.all_kwargs()
            if kw.get("GLUON") and not gluon:
                raise ValueError("accelc::flash_attention: a Gluon config for a call the Gluon kernel cannot take")
            kernel, constexprs = plan(kw)
            launch_kernel(kernel, (triton.cdiv(L, kw["BLOCK_M"]), B * H),
                          _args(kw, q, k, v, mask_t, out, mask is not None, scale, fp8_ops), constexprs)

        # the tuning key: lengths by their next power of two
        key = (triton.next_power_of_2(L), triton.next_power_of_2(S), D, meta["MASK_KIND"], meta["MASK_ROW"],
               bool(is_causal), bool(qk_int8), use_tma, q.dtype, *(("tf32",) if tf32 else ()),
               *(("gluon",) if gluon else ()), *(("fp8",) if fp8 else ()))
        cfg = TUNER.pick(key, dict(B=B, H=H, L=L, S=S, D=D, tma=use_tma, fp32=fp32, gluon=gluon, fp8=bool(fp8)), run)
        kw = cfg.all_kwargs()
        kernel, constexprs = plan(kw)
        TUNER.calls[sig] = (CompiledCall(kernel, (triton.cdiv(L, kw["BLOCK_M"]), B * H),
                                         _args(kw, q, k, v, mask_t, out, mask is not None, scale, fp8_ops),
                                         constexprs), kw)
    return


def _launch_in_slices(q, k, v, mask, is_causal, scale, qk_int8, empty_nan, out, allow_tf32, fp8=False):
    """A call whose batch x heads exceeds the grid's second dimension (MAX_GRID_Y: a launch past it
    fails), run as slices of the batch, or, where the heads alone exceed it (attention written with
    bmm: batch x heads as one dim), of the heads in whole query groups: views of the same tensors,
    each launched as its own call."""
    B, H, L, _ = q.shape
    group = H // k.shape[1]
    m = None if mask is None else mask.expand(B, H, L, k.shape[2])
    if H <= MAX_GRID_Y:
        step = MAX_GRID_Y // H
        for b0 in range(0, B, step):
            rows = slice(b0, b0 + step)
            _launch(q[rows], k[rows], v[rows], None if m is None else m[rows], is_causal, scale, qk_int8, empty_nan,
                    out[rows], allow_tf32, fp8)
        return
    step = max(MAX_GRID_Y // group, 1) * group
    for b in range(B):
        for h0 in range(0, H, step):
            heads, kv_heads = slice(h0, h0 + step), slice(h0 // group, (h0 + step) // group)
            _launch(q[b:b + 1, heads], k[b:b + 1, kv_heads], v[b:b + 1, kv_heads],
                    None if m is None else m[b:b + 1, heads], is_causal, scale, qk_int8, empty_nan,
                    out[b:b + 1, heads], allow_tf32, fp8)


def _fp8_operands(q, k, v) -> tuple:
    """(q, K, V in e4m3, their scales): kernels/attention_fp8.py."""
    q8, qs = attention_fp8.quantize_rows(q)
    k8, ks = attention_fp8.quantize_rows(k)
    v8, vs = attention_fp8.quantize_columns_transposed(v)
    return (q8, k8, v8), (qs, ks, vs)


def _args(kw, q, k, v, mask_t, out, has_mask, scale, fp8_ops=None) -> tuple:
    """_flash_fwd_kernel's positional arguments for a config's kwargs: TMA descriptors (boxes
    of the config's rows and the padded head dim) where the config loads by TMA, else the tensors;
    with fp8_ops (_fp8_operands) the e4m3 copies and their scales in place of q, k, v."""
    B, H, L, D = q.shape
    scales = (q, q, q)          # placeholders, read only with FP8
    if fp8_ops is not None:
        (q, k, v), scales = fp8_ops
    if kw.get("GLUON"):
        return (*_hopper().descriptors(q, k, v, kw["BLOCK_N"]), out, mask_t, *scales, H, H // k.shape[1], L, k.shape[2],
                softmax_scale(q, scale) * LOG2E, *out.stride()[:3],
                *(mask_t.stride() if has_mask else (0, 0, 0, 0)))
    if kw["TMA"]:
        bd = triton.next_power_of_2(D)
        descs = [TensorDescriptor.from_tensor(tma_view(t), [1, 1, rows, bd])
                 for t, rows in ((q, kw["BLOCK_M"]), (k, kw["BLOCK_N"]), (v, kw["BLOCK_N"]))]
    else:
        descs = [q, k, v]
    return (q, k, v, mask_t, out, *scales, *descs, H, H // k.shape[1], L, k.shape[2], softmax_scale(q, scale) * LOG2E,
            *q.stride(), *k.stride(), *v.stride(), *(mask_t.stride() if has_mask else (0, 0, 0, 0)), *out.stride())


def _quantize_rows(t):
    """int8 per-row (last dim) quantization as the kernel does it, returned dequantized."""
    q, s = quantize_ref(t)
    return q.to(t.dtype) * s[..., None].to(t.dtype)


def flash_attention_ref(q, k, v, mask=None, is_causal=False, scale=None, qk_int8=False, empty_nan=False,
                        allow_tf32=False, fp8=False):
    """Pure-PyTorch reference in fp32 (fp64 for fp64 inputs), result in q's dtype. qk_int8:
    q and k quantized per token first, as the kernel does. empty_nan: a row with no visible key
    gives NaN (softmax's 0 / 0) instead of SDPA's 0. allow_tf32 (the op's argument) changes nothing
    here: the reference stays true fp32; nor does fp8 (the guard judges the fp8 kernel by SQNR against it)."""
    if q.dim() == k.dim() == v.dim() == 3:
        return flash_attention_ref(q[None], k[None], v[None], mask, is_causal, scale, qk_int8, empty_nan)[0]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if qk_int8:
        q, k = _quantize_rows(q.to(acc)), _quantize_rows(k.to(acc))
    if k.shape[1] != q.shape[1]:   # grouped-query attention: each K/V head serves H / Hkv query heads
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(acc)
    if is_causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    p = torch.softmax(s, dim=-1)
    if not empty_nan:
        p = torch.where(torch.isneginf(s).all(-1, keepdim=True), 0.0, p)   # no visible key: 0, as SDPA
    return torch.matmul(p, v.to(acc)).to(q.dtype)


@torch.library.custom_op("accelc::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                    is_causal: bool = False, scale: Optional[float] = None, qk_int8: bool = False,
                    empty_nan: bool = False, allow_tf32: bool = False, fp8: bool = False) -> torch.Tensor:
    """softmax(q @ k^T * scale + mask) @ v: see the module docstring."""
    return runtime.launch_or_fallback("flash_attention", q.device, flash_attention_launch, _ref_in_out_layout,
                                      q, k, v, mask, is_causal, scale, qk_int8, empty_nan, allow_tf32, fp8)


def _ref_in_out_layout(q, k, v, mask, is_causal, scale, qk_int8, empty_nan=False, allow_tf32=False, fp8=False):
    return _empty_out(q).copy_(flash_attention_ref(q, k, v, mask, is_causal, scale, qk_int8, empty_nan))


def _empty_out(q):
    if q.dim() != 4:        # 3-D: contiguous, as bmm's; other ranks are refused by the check after this
        return q.new_empty(q.shape)
    B, H, L, D = q.shape
    return q.new_empty((B, L, H, D)).transpose(1, 2)


@flash_attention.register_fake
def _(q, k, v, mask=None, is_causal=False, scale=None, qk_int8=False, empty_nan=False, allow_tf32=False,
      fp8=False):
    return _empty_out(q)
