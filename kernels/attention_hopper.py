"""accelc::flash_attention on Hopper (sm90): a warp-specialized Gluon kernel after FlashAttention-3.

The same op as kernels/flash_attention.py (softmax(q @ k^T * scale + mask) @ v, fp16 / bf16, fp32
softmax and accumulators, grouped-query heads, additive or boolean masks, top-left causal), written
in Gluon because Triton's `tl` cannot say what FA3 does on Hopper (Shah et al. 2024):

- one CTA per 64 x CONSUMERS query rows of one (batch, head); a **load partition** (a warpgroup;
  see kernels/gemm_hopper.py for why not one warp) brings the q tile's 64-row parts and then, for
  every key block, K and V by TMA into a ring of STAGES slots. K and V have a barrier each
  (`k_ready`, `v_ready`), so q @ k^T starts before V has landed;
- CONSUMERS **softmax partitions** (one warpgroup each, 64 rows) share every K / V slot (`kv_empty`
  counts their releases). Each runs q @ k^T on the tensor cores (wgmma, q from shared memory), the
  online softmax in registers (base 2, as the tl kernel), and p @ v with p as the register operand:
  no trip through shared memory; the causal and bounds masks only where a block crosses the
  diagonal or the end of the keys;
- block j's q @ k^T and block j-1's p @ v are issued together (FA3's intra-warpgroup order; ptxas
  moves the wait for p @ v ahead of block j's softmax, so the overlap comes from the other softmax
  warpgroups' MMAs, which run while this one computes its softmax, interleaved by the SM's
  schedulers or, with PINGPONG, issued in turns: FA3's scheduler barrier);
- two softmax warpgroups (128 query rows a CTA) or three (192: FA3's tile for head dim 64, each K /
  V block read from L2 once for 192 rows).

Inputs are read as (1, 1, rows, D) boxes of 4-D descriptors over the tensors' own strides (the
(B, S, H, D) memory that the head split views as (B, H, S, D) costs no copy); the copy engine
zero-fills rows past L and S per (batch, head), so another sequence's keys never enter a block (its
NaN / inf could not leak into this one's result). Key columns past S, the causal triangle and the
mask are applied in registers. The output (B, L, H, D) memory is written by masked stores. Head
dims 32, 64 and 128 (powers of two: Gluon's tensors and the wgmma tiles). A row with no visible key
gives 0 as SDPA does, or NaN with EMPTY_NAN, as the tl kernel.

FP8 (Fp8Config(attention=True)): q, K and V arrive as the e4m3 copies kernels/attention_fp8.py makes (V stored
keys-contiguous, (B, Hkv, D, S) boxes of (D, BLOCK_N): the K-major operand fp8 wgmma takes for p @ V), both
products on fp8 tensor cores with fp32 accumulators; the scores times q's row scale and K's key scale before the
softmax, p x 448 in e4m3 as p @ V's register operand, the output times V's column scales / 448 at the end.

The launcher (kernels/flash_attention.py) races these candidates with the tl kernel's where the
operands qualify (`gluon_problem`); everything else, the CPU interpreter included, runs the tl
kernel, which is also the reference these are tested against (tests/test_attention_hopper.py).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from accelc.kernels.primitives import log2_units, tma_view
from accelc.kernels.gemm_hopper import GL_DTYPES, ring_slot, tma_load
from accelc.kernels.hopper_args import AttnArgs

HEAD_DIMS = (32, 64, 128)


@gluon.jit
def _tile(H, IS_CAUSAL: gl.constexpr):
    """(start_m, b, h) of this CTA; causal grids run their longest rows (the last blocks) first."""
    start_m = gl.program_id(0)
    if IS_CAUSAL:
        start_m = gl.num_programs(0) - 1 - start_m
    bh = gl.program_id(1)
    return start_m, bh // H, bh % H


@gluon.jit
def _key_blocks(start_m, S, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """Key blocks this CTA's rows see: all of S, or up to the causal diagonal."""
    if IS_CAUSAL:
        hi = gl.minimum(S, (start_m + 1) * BLOCK_M)
    else:
        hi = S
    return gl.cdiv(hi, BLOCK_N)


@gluon.jit
def _load_partition(p):
    """The producer: the q tile's 64-row parts once, then K and V of every key block into the ring."""
    CONSUMERS: gl.constexpr = p.CONSUMERS
    PART: gl.constexpr = p.q_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = p.k_desc.block_type.shape[2]
    start_m, b, h = _tile(p.H, p.IS_CAUSAL)
    hk = h // p.GROUP
    mbarrier.expect(p.q_ready, CONSUMERS * p.q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        tma_load(p.q_desc, [b, h, (start_m * CONSUMERS + c) * PART, 0], p.q_ready, p.q_bufs.index(c))
    for j in range(_key_blocks(start_m, p.S, CONSUMERS * PART, BLOCK_N, p.IS_CAUSAL)):
        slot, phase = ring_slot(j, p.STAGES)
        # a slot starts empty: the first wait of each (phase 1) passes at once; every softmax
        # partition releases it before it is filled again
        mbarrier.wait(p.kv_empty.index(slot), phase ^ 1)
        mbarrier.expect(p.k_ready.index(slot), p.k_desc.block_type.nbytes)
        tma_load(p.k_desc, [b, hk, j * BLOCK_N, 0], p.k_ready.index(slot), p.k_bufs.index(slot))
        mbarrier.expect(p.v_ready.index(slot), p.v_desc.block_type.nbytes)
        if p.FP8:       # V^T's (D, BLOCK_N) box: the keys contiguous
            tma_load(p.v_desc, [b, hk, 0, j * BLOCK_N], p.v_ready.index(slot), p.v_bufs.index(slot))
        else:
            tma_load(p.v_desc, [b, hk, j * BLOCK_N, 0], p.v_ready.index(slot), p.v_bufs.index(slot))


@gluon.jit
def _softmax_step(s, j, m_i, l_i, row0, offs_m, mask_base, L, S, qk_scale, stride_mm, stride_mn, ks_base,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr, MASK_KIND: gl.constexpr, MASK_ROW: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, FOLD: gl.constexpr, FP8: gl.constexpr):
    """Key block j's online-softmax step on the raw scores s: (p, fp32 in the scores' registers, the
    new row max, the new row sum, the factor that rescales the accumulator). MASK_ROW: the mask is
    the same for every query row (a key padding mask), read as one row of the block. FOLD (no mask,
    a scale > 0): the scale multiplies the row max (max(c x) = c max(x) for c > 0) and folds into one
    fma with its subtraction, one float op an element fewer, as the tl kernel's. FP8: qk_scale is the
    (HALF,) vector of q's row scales x the softmax scale, ks_base K's scales (one a key)."""
    offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if FP8:
        s = s * qk_scale[:, None] * gl.load(ks_base + offs_n, mask=offs_n < S, other=0.0)[None, :]
    elif not FOLD:
        s = s * qk_scale                                    # log2 units: exp2 below
    if MASK_KIND != 0:
        if MASK_ROW:
            m = gl.load(mask_base + offs_n * stride_mn, mask=offs_n < S, other=0)[None, :]
        else:
            m = gl.load(mask_base + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn,
                        mask=(offs_m[:, None] < L) & (offs_n[None, :] < S), other=0)
        if MASK_KIND == 1:      # additive float mask, natural-log units
            s = s + log2_units(m)
        else:                   # boolean mask: True attends
            s = gl.where(m != 0, s, float("-inf"))
    if IS_CAUSAL:
        if (j + 1) * BLOCK_N > row0 + 1:                    # a key past this warpgroup's first row
            s = gl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    if (j + 1) * BLOCK_N > S:                               # the ragged end of the keys
        s = gl.where(offs_n[None, :] < S, s, float("-inf"))
    if FOLD:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1))
    # a row with no visible key so far keeps m = -inf: subtract 0 instead (p = 0, no NaN)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    if FOLD:
        p = gl.exp2(s * qk_scale - m_sub[:, None])
    else:
        p = gl.exp2(s - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _operand(p, dtype: gl.constexpr, p_layout: gl.constexpr, FP8: gl.constexpr):
    """p as p @ v's register operand, written once the previous p @ v has retired (FA3's order: its
    operand registers are not redefined while it runs); FP8: p (in [0, 1]) x 448 in e4m3."""
    if FP8:
        p = p * 448.0
    return gl.convert_layout(p.to(dtype), p_layout)


@gluon.jit
def _take_turn(turn, t, CONSUMER: gl.constexpr, PINGPONG: gl.constexpr):
    """FA3's warp scheduler barrier: the softmax warpgroups issue their MMAs in turns, round robin, so
    one's MMAs run while the others do their softmax (instead of all contending for the tensor cores
    and then all leaving them idle). t: this warpgroup's turns so far; warpgroup 0 goes first and
    waits, from its second turn, for the last one's t-th pass; warpgroup c > 0 for c - 1's
    (t+1)-th. Strict rotation: no barrier phase can alias."""
    if PINGPONG:
        if CONSUMER == 0:
            mbarrier.wait(turn.index(0), (t + 1) & 1, pred=t > 0)
        else:
            mbarrier.wait(turn.index(CONSUMER), t & 1)


@gluon.jit
def _pass_turn(turn, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(turn.index((CONSUMER + 1) % CONSUMERS), count=1)


@gluon.jit
def _v_operand(v_buf, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr, FP8: gl.constexpr):
    """A V slot as p @ V's (BLOCK_N, HEAD_D) operand: as loaded, or FP8's (HEAD_D, BLOCK_N) box transposed (the
    keys, the products' K dim, contiguous)."""
    if FP8:
        v = v_buf.reshape([HEAD_D, BLOCK_N]).permute((1, 0))
    else:
        v = v_buf.reshape([BLOCK_N, HEAD_D])
    return v


@gluon.jit
def _softmax_partition(a, CONSUMER: gl.constexpr):
    """One warpgroup: 64 query rows (part CONSUMER of the tile) against every key block."""
    q_bufs, k_bufs, v_bufs = a.q_bufs, a.k_bufs, a.v_bufs
    k_ready, v_ready, kv_empty, turn = a.k_ready, a.v_ready, a.kv_empty, a.turn
    H, L, S, qk_scale, stride_mm, stride_mn = a.H, a.L, a.S, a.qk_scale, a.stride_mm, a.stride_mn
    MASK_KIND: gl.constexpr = a.MASK_KIND
    MASK_ROW: gl.constexpr = a.MASK_ROW
    IS_CAUSAL: gl.constexpr = a.IS_CAUSAL
    STAGES: gl.constexpr = a.STAGES
    PINGPONG: gl.constexpr = a.PINGPONG
    FOLD: gl.constexpr = a.FOLD
    CONSUMERS: gl.constexpr = a.CONSUMERS
    FP8: gl.constexpr = a.FP8
    dtype: gl.constexpr = a.q_desc.dtype
    HALF: gl.constexpr = a.q_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = a.q_desc.block_type.shape[3]
    BLOCK_N: gl.constexpr = a.k_desc.block_type.shape[2]
    # instructions 64 x N x (32 bytes): K 16 on fp16 / bf16 operands, 32 on e4m3 ones
    INSTR_K: gl.constexpr = 32 if FP8 else 16
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, INSTR_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_D, INSTR_K])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    start_m, b, h = _tile(H, IS_CAUSAL)
    row0 = (start_m * CONSUMERS + CONSUMER) * HALF
    offs_m = row0 + gl.arange(0, HALF, layout=row_s)
    mask_base = a.mask_ptr + b * a.stride_mb + h * a.stride_mh
    n_blocks = _key_blocks(start_m, S, CONSUMERS * HALF, BLOCK_N, IS_CAUSAL)
    hk = h // a.GROUP
    ks_base = a.ks_ptr + (b * (H // a.GROUP) + hk) * S
    if FP8:     # q's row scales (the scores' rows) folded with the softmax scale
        qk_scale = gl.load(a.qs_ptr + (b * H + h) * L + offs_m, mask=offs_m < L, other=0.0) * qk_scale
    m_i = gl.full([HALF], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([HALF], gl.float32, row_s)
    acc = gl.zeros([HALF, HEAD_D], gl.float32, o_layout)
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(a.q_ready, 0)
    q = q_bufs.index(CONSUMER).reshape([HALF, HEAD_D])
    # block 0's scores and softmax; then per block j: q @ k_j^T and p_{j-1} @ v_{j-1} issued
    # together (in this warpgroup's turn), the softmax of j, the rescale once p @ v retired.
    # (ptxas moves the wait for p @ v ahead of the softmax, so the overlap comes from the other
    # warpgroup's MMAs, which the turns put there)
    mbarrier.wait(k_ready.index(0), 0)
    _take_turn(turn, 0, CONSUMER, PINGPONG)
    s = warpgroup_mma(q, k_bufs.index(0).reshape([BLOCK_N, HEAD_D]).permute((1, 0)), s_zero,
                      use_acc=False, is_async=True)
    _pass_turn(turn, CONSUMER, CONSUMERS, PINGPONG)
    s = warpgroup_mma_wait(0, deps=(s, ))
    p, m_i, l_i, alpha = _softmax_step(s, 0, m_i, l_i, row0, offs_m, mask_base, L, S, qk_scale, stride_mm, stride_mn,
                                       ks_base, BLOCK_N, s_layout, MASK_KIND, MASK_ROW, IS_CAUSAL, FOLD, FP8)
    p = _operand(p, dtype, p_layout, FP8)
    for j in range(1, n_blocks):
        slot, phase = ring_slot(j, STAGES)
        prev, prev_phase = ring_slot(j - 1, STAGES)
        mbarrier.wait(k_ready.index(slot), phase)
        mbarrier.wait(v_ready.index(prev), prev_phase)
        _take_turn(turn, j, CONSUMER, PINGPONG)
        s = warpgroup_mma(q, k_bufs.index(slot).reshape([BLOCK_N, HEAD_D]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        acc = warpgroup_mma(p, _v_operand(v_bufs.index(prev), BLOCK_N, HEAD_D, FP8), acc, is_async=True)
        _pass_turn(turn, CONSUMER, CONSUMERS, PINGPONG)
        if FP8:     # an e4m3 register operand cannot be a wait's dependency: both retire before p is redefined
            s, acc = warpgroup_mma_wait(0, deps=(s, acc))
        else:
            s = warpgroup_mma_wait(1, deps=(s, ))        # the scores are in; p @ v may still run
        p_next, m_i, l_i, alpha = _softmax_step(s, j, m_i, l_i, row0, offs_m, mask_base, L, S, qk_scale,
                                                stride_mm, stride_mn, ks_base, BLOCK_N, s_layout, MASK_KIND,
                                                MASK_ROW, IS_CAUSAL, FOLD, FP8)
        if not FP8:
            acc, p = warpgroup_mma_wait(0, deps=(acc, p))    # p stays live until its MMA retired
        mbarrier.arrive(kv_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p = _operand(p_next, dtype, p_layout, FP8)
    last, last_phase = ring_slot(n_blocks - 1, STAGES)
    mbarrier.wait(v_ready.index(last), last_phase)
    _take_turn(turn, n_blocks, CONSUMER, PINGPONG)
    acc = warpgroup_mma(p, _v_operand(v_bufs.index(last), BLOCK_N, HEAD_D, FP8), acc, is_async=True)
    _pass_turn(turn, CONSUMER, CONSUMERS, PINGPONG)
    if FP8:
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    else:
        acc, p = warpgroup_mma_wait(0, deps=(acc, p))
    mbarrier.arrive(kv_empty.index(last), count=1)

    offs_d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    if FP8:     # V's column scales, p's 448 out
        acc = acc * (gl.load(a.vs_ptr + (b * (H // a.GROUP) + hk) * HEAD_D + offs_d) * (1.0 / 448.0))[None, :]
    # a row with no visible key (l == 0, acc == 0) gives 0, as SDPA does, or NaN (0 / 0) with
    # EMPTY_NAN; a NaN l stays NaN
    l_o = gl.convert_layout(l_i, row_o)
    if a.EMPTY_NAN:
        out = acc / l_o[:, None]
    else:
        out = gl.where(l_o[:, None] == 0.0, 0.0, acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None])
    offs_mo = row0 + gl.arange(0, HALF, layout=row_o)
    gl.store(a.out_ptr + b * a.stride_ob + h * a.stride_oh + offs_mo[:, None] * a.stride_om + offs_d[None, :],
             out.to(a.out_ptr.dtype.element_ty), mask=(offs_mo[:, None] < L) & (offs_d[None, :] < HEAD_D))


# the lengths, and the mask strides that follow them (a row of S keys): one binary for every length
@gluon.jit(do_not_specialize=["L", "S"], do_not_specialize_on_alignment=["stride_mb", "stride_mh", "stride_mm"])
def attention_ws_kernel(
    # TMA descriptors of q (B, H, L, D), k and v (B, Hkv, S, D): (1, 1, rows, D) boxes
    q_desc, k_desc, v_desc,
    # the output (B, H, L, D) view, its head dim contiguous; the mask (B, H, L, S) view (q's when none); with
    # FP8 the e4m3 operands' scales: q's a row (B, H, L), K's a key (B, Hkv, S), V's a column (B, Hkv, D)
    out_ptr, mask_ptr, qs_ptr, ks_ptr, vs_ptr,
    # sizes (GROUP = H / Hkv query heads share a K/V head) and the softmax scale x log2(e)
    H, GROUP, L, S, qk_scale,
    stride_ob, stride_oh, stride_om, stride_mb, stride_mh, stride_mm, stride_mn,
    MASK_KIND: gl.constexpr, MASK_ROW: gl.constexpr, IS_CAUSAL: gl.constexpr, EMPTY_NAN: gl.constexpr,
    STAGES: gl.constexpr, PINGPONG: gl.constexpr, FOLD: gl.constexpr,
    CONSUMERS: gl.constexpr, SOFTMAX_REGS: gl.constexpr, LOAD_REGS: gl.constexpr, FP8: gl.constexpr,
    num_warps: gl.constexpr,
):
    # CONSUMERS softmax warpgroups of 64 query rows each (2: 128 rows a CTA; 3: 192, FA3's tile for
    # head dim 64: K / V read from L2 once per 192 rows)
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=CONSUMERS)     # every softmax warpgroup releases a slot

    p = AttnArgs(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turn, out_ptr,
                 mask_ptr, H, GROUP, L, S, qk_scale, stride_ob, stride_oh, stride_om, stride_mb, stride_mh, stride_mm,
                 stride_mn, qs_ptr, ks_ptr, vs_ptr, MASK_KIND, MASK_ROW, IS_CAUSAL, EMPTY_NAN, STAGES, PINGPONG, FOLD,
                 CONSUMERS, FP8)
    if CONSUMERS == 2:
        gl.warp_specialize([(_softmax_partition, (p, 0)), (_softmax_partition, (p, 1)), (_load_partition, (p, ))],
                           [4, 4], [SOFTMAX_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([(_softmax_partition, (p, 0)), (_softmax_partition, (p, 1)), (_softmax_partition, (p, 2)),
                            (_load_partition, (p, ))], [4, 4, 4], [SOFTMAX_REGS, SOFTMAX_REGS, LOAD_REGS])


def smem_bytes(block_n: int, head_d: int, stages: int, consumers: int = 2, elem: int = 2) -> int:
    """Shared memory a config takes: the q tile (64 rows a consumer), the K and V ring, the barriers."""
    return 64 * consumers * head_d * elem + 2 * stages * block_n * head_d * elem + (1 + 3 * stages + consumers) * 8


def descriptors(q, k, v, block_n: int):
    """The kernel's TMA descriptors: q in 64-row parts, K and V in block_n-row boxes; e4m3 V (the keys-contiguous
    copy, a (B, Hkv, S, D) view of (B, Hkv, D, S) memory) in (D, block_n) boxes of that memory."""
    dt = GL_DTYPES[q.dtype]

    def desc(t, box):
        return TensorDescriptor.from_tensor(tma_view(t), box, gl.NVMMASharedLayout.get_default_for(box, dt))

    if q.dtype == torch.float8_e4m3fn:
        vt = v.transpose(2, 3)
        return desc(q, [1, 1, 64, q.shape[3]]), desc(k, [1, 1, block_n, k.shape[3]]), desc(vt, [1, 1, vt.shape[2], block_n])
    return desc(q, [1, 1, 64, q.shape[3]]), desc(k, [1, 1, block_n, k.shape[3]]), desc(v, [1, 1, block_n, v.shape[3]])
