"""Flash-decoding: accelc::flash_attention's path for a few query rows over a long key sequence
(a decode step over a KV cache), where one program per (batch, head, BLOCK_M rows) would leave
most SMs idle and reread each K/V head once per query head of its group.

Split-KV (Dao et al., "Flash-Decoding for long-context inference", 2023), one kernel:
  1. _split_kernel, one program per (batch, K/V head, split of S): the query rows of every query
     head of the K/V head's group stacked as one tile (GROUP x L rows: each K/V block is read
     once for the whole group, as GQA intends), the split's keys streamed in BLOCK_N blocks with
     the online softmax of kernels/flash_attention.py (base 2, fp32); writes the split's row max,
     row sum and unnormalised accumulator to fp32 scratch;
  2. the combine: the last program of a (batch, K/V head) to finish (a ticket counter, atomic)
     rescales the splits to the common max and divides, writing out in flash_attention's layout.
     A decode step's second kernel (5.3 us a layer on an H100 at TinyLlama's shape, more than the
     split's 3.9) is gone; _combine_kernel does it as a kernel of its own only where no counters
     are at hand (_counters).
`paged` runs the same two kernels over a paged KV cache (vLLM's PagedAttention, in
flash_attn_with_kvcache's layout): each key's row found through the sequence's block table, each
sequence's keys ending at its own length (a ragged batch reads no padding); accelc::paged_attention
(kernels/paged_attention.py) serves generation's paged cache with it.
The number of splits fills the SMs (PROGRAMS_PER_SM programs an SM), each split a whole number of
key blocks, blocks twice as long where a split holds WIDE_BLOCKS of them (split_plan).
With a boolean mask, a key block no query row of the tile attends (a static cache's slots
past the current length, a left pad) is skipped before its K/V are read: it cannot change the
result, whatever its keys and values hold (eager's SDPA would turn a NaN value there into a NaN
output; accelc's static cache never holds one). Mask semantics, scale, empty rows (0, or NaN with
empty_nan) and NaN in q, k or v at attended keys are flash_attention's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from accelc import runtime
from accelc.kernels.primitives import log2_units, sm_count, softmax_update
from accelc.kernels.pdl import enabled as pdl_enabled, wait_for_producers

LOG2E = 1.4426950408889634     # the kernels' softmax runs in base 2: scores x log2(e), then exp2


def softmax_scale(q, scale) -> float:
    """The softmax scale of attention over q (B, H, L, D): the caller's, or 1 / sqrt(D)."""
    return scale if scale is not None else q.shape[-1] ** -0.5

MAX_ROWS = 64          # query rows of one K/V head (GROUP x L) this path takes
MAX_QUERIES = 16       # query positions (a decode step's 1, a few drafted tokens) this path takes
MIN_KEYS = 256         # keys below which one program a (batch, head) already has work enough
# the split plan (bench/decode.py --attention, decode_attention-*.md, H100: one program an SM, and key
# blocks of 128 where a split holds 256 keys or more, the fastest plan or within 1% of it at all six shapes)
PROGRAMS_PER_SM = 1
WIDE_BLOCKS = 4
# keys a split holds at the least (0: as many splits as the SMs want). A whole 0.5B / 1.5B decode step spent 19% of
# its GPU time in this kernel at a short context, 7 / 12.5 us a layer for 0.3 / 0.6 MB of keys and values, its twelve
# one-block splits and their combine serial latency: fewer, longer splits are raced by bench/decode.py --attention
MIN_KEYS_PER_SPLIT = 0
COMBINE_ELEMENTS = 8192   # accumulator values the combine loads at once (64 fp32 registers a thread)


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, ml_ptr, table_ptr, lens_ptr, out_ptr, count_ptr,
                  Hkv, GROUP, L, S, KEYS_PER_SPLIT, qk_scale,
                  stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, stride_mh, stride_mm, stride_mn,
                  stride_tb, stride_ob, stride_oh, stride_om, stride_od,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK_KIND: tl.constexpr, DOT_IN_FP32: tl.constexpr, EMPTY_NAN: tl.constexpr,
                  FUSED_COMBINE: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr, PAGE: tl.constexpr = 0,
                  PDL: tl.constexpr = False):
    # PAGE > 0: a paged cache (flash_attn_with_kvcache's layout): k / v are (blocks, PAGE, Hkv, D), the
    # b-th sequence's key p in block table[b, p // PAGE] at row p % PAGE (stride_kb / stride_vb: a
    # block's stride, stride_kn / stride_vn: a row's), and its keys end at lens[b]
    wait_for_producers(PDL)        # every input is an earlier kernel's output (the cache just written)
    split = tl.program_id(0)
    bh = tl.program_id(1)
    splits = tl.num_programs(0)
    b = bh // Hkv
    hk = bh % Hkv
    rows = tl.arange(0, BLOCK_M)              # row r: query head hk * GROUP + r // L, position r % L
    h = hk * GROUP + rows // L
    pos = rows % L
    r_ok = rows < GROUP * L
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + pos[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    if PAGE > 0:
        k_base = k_ptr + hk * stride_kh
        v_base = v_ptr + hk * stride_vh
        S = tl.minimum(S, tl.load(lens_ptr + b))
    else:
        k_base = k_ptr + b * stride_kb + hk * stride_kh
        v_base = v_ptr + b * stride_vb + hk * stride_vh
    m_rows = mask_ptr + b * stride_mb + h * stride_mh + pos * stride_mm          # (BLOCK_M,) pointers

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo = split * KEYS_PER_SPLIT
    hi = tl.minimum(lo + KEYS_PER_SPLIT, S)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        live = r_ok[:, None] & n_ok[None, :]
        if MASK_KIND == 2:
            keep = tl.load(m_rows[:, None] + offs_n[None, :] * stride_mn, mask=live, other=0) != 0
            attended = tl.sum(tl.sum(keep.to(tl.int32), 1), 0) > 0
        else:
            attended = True
        if attended:        # a block no row attends is not read (see the module docstring)
            if PAGE > 0:    # each key's row: its block (from the table) x the block's stride + its row in it
                blk = tl.load(table_ptr + b * stride_tb + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
                k_row = blk * stride_kb + (offs_n % PAGE) * stride_kn
                v_row = blk * stride_vb + (offs_n % PAGE) * stride_vn
            else:
                k_row = offs_n * stride_kn
                v_row = offs_n * stride_vn
            kt = tl.load(k_base + k_row[None, :] + offs_d[:, None] * stride_kd,
                         mask=d_ok[:, None] & n_ok[None, :], other=0.0)            # (BLOCK_D, BLOCK_N)
            v = tl.load(v_base + v_row[:, None] + offs_d[None, :] * stride_vd,
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)             # (BLOCK_N, BLOCK_D)
            if DOT_IN_FP32:
                qk = tl.dot(q.to(tl.float32), kt.to(tl.float32))
            else:
                qk = tl.dot(q, kt)
            qk = qk * qk_scale                                                      # log2 units
            if MASK_KIND == 1:
                add = tl.load(m_rows[:, None] + offs_n[None, :] * stride_mn, mask=live, other=0.0)
                qk += log2_units(add)
            elif MASK_KIND == 2:
                qk = tl.where(keep, qk, float("-inf"))
            qk = tl.where(n_ok[None, :], qk, float("-inf"))
            if PAGE > 0:    # the new positions among themselves, causal: position pos sees keys < S - (L - 1 - pos)
                qk = tl.where(offs_n[None, :] < (S - (L - 1 - pos))[:, None], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_sub[:, None])
            acc, l_i, m_i = softmax_update(acc, l_i, m_i, m_new, m_sub, p, v, DOT_IN_FP32, "ieee")
    slot = bh * splits + split
    tl.store(acc_ptr + (slot * BLOCK_M + rows[:, None]) * BLOCK_D + offs_d[None, :], acc)
    tl.store(ml_ptr + (slot * 2) * BLOCK_M + rows, m_i)
    tl.store(ml_ptr + (slot * 2 + 1) * BLOCK_M + rows, l_i)
    if FUSED_COMBINE:
        # the last split of (b, hk) to finish combines them all: every thread's stores made before the
        # ticket (barrier, then a gpu-scope acquire-release atomic); the counter set back to 0 for the
        # next launch (see _counters)
        tl.debug_barrier()
        ticket = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            combine_rows(acc_ptr, ml_ptr, out_ptr, bh, Hkv, GROUP, L, splits, stride_ob, stride_oh, stride_om,
                          stride_od, HEAD_DIM, BLOCK_D, BLOCK_M, EMPTY_NAN, ROWS, CHUNK)
            tl.atomic_xchg(count_ptr + bh, 0, sem="relaxed", scope="gpu")


@triton.jit
def _combine_kernel(acc_ptr, ml_ptr, out_ptr, Hkv, GROUP, L, SPLITS,
                    stride_ob, stride_oh, stride_om, stride_od,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, EMPTY_NAN: tl.constexpr,
                    ROWS: tl.constexpr, CHUNK: tl.constexpr):
    combine_rows(acc_ptr, ml_ptr, out_ptr, tl.program_id(0), Hkv, GROUP, L, SPLITS, stride_ob, stride_oh, stride_om,
                  stride_od, HEAD_DIM, BLOCK_D, BLOCK_M, EMPTY_NAN, ROWS, CHUNK)


@triton.jit
def combine_rows(acc_ptr, ml_ptr, out_ptr, bh, Hkv, GROUP, L, SPLITS, stride_ob, stride_oh, stride_om, stride_od,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, EMPTY_NAN: tl.constexpr,
                  ROWS: tl.constexpr, CHUNK: tl.constexpr):
    """The SPLITS partial results of (batch, K/V head) bh rescaled to their common row max, summed,
    divided and written to out. CHUNK splits at a time, each chunk's row maxes, sums and
    accumulators loaded at once (one round trip to L2, not one a split), folded in as the split
    kernel folds key blocks (online rescaling); only the ROWS real rows of the tiles (GROUP x L, to
    a power of two). Loads through L2 only (.cg): in the fused form another SM wrote them during
    this kernel, and an SM's L1 is not coherent with other SMs' writes."""
    b = bh // Hkv
    hk = bh % Hkv
    rows = tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    chunk = tl.arange(0, CHUNK)
    m_run = tl.full((ROWS,), float("-inf"), tl.float32)
    l_run = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
    for s0 in range(0, SPLITS, CHUNK):
        ok = (s0 + chunk) < SPLITS
        slot = bh * SPLITS + s0 + chunk                                                  # (CHUNK,)
        m = tl.load(ml_ptr + (slot[:, None] * 2) * BLOCK_M + rows[None, :], mask=ok[:, None],
                    other=float("-inf"), cache_modifier=".cg")                          # (CHUNK, ROWS)
        l = tl.load(ml_ptr + (slot[:, None] * 2 + 1) * BLOCK_M + rows[None, :], mask=ok[:, None], other=0.0,
                    cache_modifier=".cg")
        a = tl.load(acc_ptr + (slot[:, None, None] * BLOCK_M + rows[None, :, None]) * BLOCK_D + offs_d[None, None, :],
                    mask=ok[:, None, None], other=0.0, cache_modifier=".cg")            # (CHUNK, ROWS, BLOCK_D)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_run - m_sub)
        w = tl.math.exp2(m - m_sub[None, :])            # a split's NaN row max makes its weight NaN, as eager
        l_run = l_run * alpha + tl.sum(w * l, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * a, 0)
        m_run = m_new
    if EMPTY_NAN:
        out = acc / l_run[:, None]
    else:
        out = tl.where(l_run[:, None] == 0.0, 0.0, acc / tl.where(l_run == 0.0, 1.0, l_run)[:, None])   # no 0 / 0
    h = hk * GROUP + rows // L
    pos = rows % L
    ok = (rows < GROUP * L)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tl.store(out_ptr + b * stride_ob + h[:, None] * stride_oh + pos[:, None] * stride_om + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=ok)


def combine_tiles(group_rows: int, block_d: int, splits: int) -> tuple[int, int]:
    """(ROWS, CHUNK) of the combine: the real rows to a power of two, and the splits loaded at once
    (at most COMBINE_ELEMENTS accumulator values)."""
    rows = triton.next_power_of_2(group_rows)
    return rows, max(1, min(triton.next_power_of_2(splits), COMBINE_ELEMENTS // (rows * block_d)))


def takes(q, k, is_causal: bool, qk_int8: bool) -> bool:
    """Whether flash_attention's call is a decode step this path serves: few query rows a K/V
    head, many keys, no causal flag (a decode step's mask says it), no int8 q @ k, fp16 / bf16."""
    B, H, L, D = q.shape
    rows = (H // k.shape[1]) * L
    return (not is_causal and not qk_int8 and q.dtype != torch.float32 and L <= MAX_QUERIES and rows <= MAX_ROWS
            and k.shape[2] >= MIN_KEYS)


def _block_n(interpreted: bool) -> int:
    return 16 if interpreted else 64


def plan(B: int, Hkv: int, S: int, sms: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split): about PROGRAMS_PER_SM programs an SM, each split whole key blocks."""
    blocks = triton.cdiv(S, block_n)
    want = max(1, min(blocks, triton.cdiv(PROGRAMS_PER_SM * max(sms, 1), B * Hkv)))
    if MIN_KEYS_PER_SPLIT:
        want = max(1, min(want, S // MIN_KEYS_PER_SPLIT))
    per = triton.cdiv(blocks, want) * block_n
    return triton.cdiv(S, per), per


def split_plan(B: int, Hkv: int, S: int, sms: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_N, splits, keys per split) of a decode call: plan's, its key blocks twice as long where
    a split holds WIDE_BLOCKS blocks or more."""
    block_n = _block_n(interpreted)
    splits, per = plan(B, Hkv, S, sms, block_n)
    if WIDE_BLOCKS and per >= WIDE_BLOCKS * block_n:
        block_n *= 2
        splits, per = plan(B, Hkv, S, sms, block_n)
    return block_n, splits, per


def _tiles(q, Hkv: int, S: int) -> tuple:
    """(BLOCK_M, BLOCK_D, BLOCK_N, splits, keys per split, the fp32 accumulator scratch, the row max /
    sum scratch) of a decode call: q (B, H, L, D) over Hkv K/V heads of S keys."""
    B, H, L, D = q.shape
    interpreted = runtime.interpreted()
    block_m = max(16, triton.next_power_of_2((H // Hkv) * L))
    block_d = triton.next_power_of_2(D)
    sms = 8 if interpreted else sm_count(q.device.index or 0)   # the interpreter: several splits at test sizes
    block_n, splits, per = split_plan(B, Hkv, S, sms, interpreted)
    acc = torch.empty((B * Hkv * splits, block_m, block_d), dtype=torch.float32, device=q.device)
    ml = torch.empty((B * Hkv * splits, 2, block_m), dtype=torch.float32, device=q.device)
    return block_m, block_d, block_n, splits, per, acc, ml


def launch(q, k, v, mask_t, has_mask: bool, qk_scale: float, empty_nan: bool, out) -> None:
    """Decode attention into `out` (flash_attention's checks and layout already done; mask_t the
    mask expanded to (B, H, L, S), or q when there is none; qk_scale the softmax scale x log2(e))."""
    B, H, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    block_m, block_d, block_n, splits, per, acc, ml = _tiles(q, Hkv, S)
    kind = 0 if not has_mask else 2 if mask_t.dtype == torch.bool else 1
    _run(q, Hkv, k.stride(), v.stride(), (k, v, mask_t, q, q), (splits, per, acc, ml, block_m, block_d, block_n),
         mask_t.stride() if has_mask else (0, 0, 0, 0), 0, S, kind, empty_nan, out, qk_scale, page=0)


def _run(q, Hkv, k_strides, v_strides, tensors, tiles, mask_strides, table_stride, S, kind, empty_nan, out, qk_scale,
         page) -> None:
    """The split kernel, combining its splits itself (FUSED_COMBINE: its last program a (batch,
    K/V head) does), or followed by _combine_kernel where no counters are at hand (see _counters)."""
    B, H, L, D = q.shape
    k, v, mask_t, table, lens = tensors
    splits, per, acc, ml, block_m, block_d, block_n = tiles
    counters = _counters(q.device, B * Hkv)
    rows, chunk = combine_tiles((H // Hkv) * L, block_d, splits)
    with runtime.device_guard(q):
        _split_kernel[(splits, B * Hkv)](
            q, k, v, mask_t, acc, ml, table, lens, out, q if counters is None else counters,
            Hkv, H // Hkv, L, S, per, qk_scale, *q.stride(), *k_strides, *v_strides, *mask_strides, table_stride,
            *out.stride(), HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, MASK_KIND=kind,
            DOT_IN_FP32=dot_in_fp32(q), EMPTY_NAN=bool(empty_nan), FUSED_COMBINE=counters is not None, ROWS=rows,
            CHUNK=chunk, PAGE=page,
            num_warps=4, num_stages=2, **({"PDL": True, "launch_pdl": True} if pdl_enabled(q.device) else {}))
        if counters is None:
            _combine(acc, ml, out, Hkv, splits, block_m, block_d, empty_nan, rows, chunk)


COUNTER_SLOTS = 1 << 20
_COUNTERS: dict = {}     # device -> [int32 counters, all 0 between launches; the next free offset]


def _counters(device: torch.device, n: int):
    """n split counters for one launch, 0 as every launch leaves them, from the device's ring of
    COUNTER_SLOTS (allocated once, 4 MiB): consecutive launches, and a CUDA graph's replays of
    them, take different slots, so decode steps replayed on two streams at once do not share a
    counter unless a million counters lie between them. None (the two-kernel path) while a CUDA
    graph is being captured before the ring exists: its allocation must not be captured."""
    entry = _COUNTERS.get(device)
    if entry is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        entry = _COUNTERS[device] = [torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device), 0]
    ring, at = entry
    if n > COUNTER_SLOTS:
        return None
    if at + n > COUNTER_SLOTS:
        at = 0
    entry[1] = at + n
    return ring[at:at + n]


def dot_in_fp32(q) -> bool:
    """tl.dot's operands taken to fp32: Triton's CPU interpreter multiplies bf16 operands wrongly."""
    return runtime.interpreted() and q.dtype == torch.bfloat16


def _combine(acc, ml, out, Hkv: int, splits: int, block_m: int, block_d: int, empty_nan: bool, rows: int,
             chunk: int) -> None:
    """The splits' partial results reduced into out (B, H, L, D)."""
    B, H, L, D = out.shape
    _combine_kernel[(B * Hkv,)](acc, ml, out, Hkv, H // Hkv, L, splits, *out.stride(),
                                HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, EMPTY_NAN=bool(empty_nan), ROWS=rows,
                                CHUNK=chunk, num_warps=4)


def paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
          seq_lens: torch.Tensor, scale: float | None = None, empty_nan: bool = False,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache (vLLM's PagedAttention; flash_attn_with_kvcache's
    layout): q (B, H, L, D) for L <= MAX_QUERIES new positions, k_cache / v_cache (blocks, page, Hkv, D)
    shared by every sequence, block_table (B, pages) int32 naming sequence b's blocks in order,
    seq_lens (B,) its keys (the new positions' included, already written to the cache). The new
    positions are the sequence's last L: each attends to the keys up to itself (causal among them, as
    drafted tokens are checked); keys past a
    sequence's length are never read, so a batch of ragged lengths does no work on padding. fp16 /
    bf16; GQA as flash_attention's. Returns (B, H, L, D) (into `out` where given). The table's
    entries and the lengths are the caller's contract, as vLLM's: checking them would cost a host
    sync a step (a length past the table's pages reads its pages only)."""
    B, H, L, D = q.shape
    blocks, page, Hkv, Dk = k_cache.shape
    why = None
    if q.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        why = f"q, k_cache and v_cache must be one of fp16 / bf16 (got {q.dtype}, {k_cache.dtype}, {v_cache.dtype})"
    elif v_cache.shape != k_cache.shape or Dk != D or H % Hkv:
        why = (f"k_cache and v_cache must be (blocks, page, Hkv, {D}) alike, Hkv dividing q's {H} heads "
               f"(got {tuple(k_cache.shape)}, {tuple(v_cache.shape)})")
    elif block_table.dim() != 2 or block_table.shape[0] != B or seq_lens.shape != (B,):
        why = (f"block_table must be (B={B}, pages) and seq_lens (B,) "
               f"(got {tuple(block_table.shape)}, {tuple(seq_lens.shape)})")
    elif page & (page - 1) or L > MAX_QUERIES or (H // Hkv) * L > MAX_ROWS:
        why = (f"the page size must be a power of two and at most {MAX_QUERIES} query positions, "
               f"{MAX_ROWS} rows a K/V head (got page {page}, {L} positions, {(H // Hkv) * L} rows)")
    elif k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        why = "k_cache and v_cache must have their head dim contiguous"
    if why:
        raise ValueError(f"flash_decoding.paged: {why}")
    S = block_table.shape[1] * page
    out = torch.empty_like(q) if out is None else out
    block_m, block_d, block_n, splits, per, acc, ml = _tiles(q, Hkv, S)
    table = block_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    _run(q, Hkv, (k_cache.stride(0), k_cache.stride(2), k_cache.stride(1), k_cache.stride(3)),
         (v_cache.stride(0), v_cache.stride(2), v_cache.stride(1), v_cache.stride(3)), (k_cache, v_cache, q, table, lens),
         (splits, per, acc, ml, block_m, block_d, block_n), (0, 0, 0, 0), table.stride(0), S, 0, empty_nan, out,
         softmax_scale(q, scale) * LOG2E, page=page)
    return out
