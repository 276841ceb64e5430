"""accelc::linear's candidates: the config tables the tuner races (tensor-core tiles by pointers and by the copy
engine, tiles fitted to narrow or shallow layers, the Gluon kernels' and the cooperative ones', the GEMV's for a
few rows, with int8 weights too), which of them a call's sizes are offered (prune_configs), and the config used
without tuning and in the interpreter. The kernels and their launch are kernels/gemm.py."""
from __future__ import annotations

import torch
import triton

from accelc.tuning import config_dict

GATE_GROUP = 16   # rows of gate, then of up, alternating in a gated weight (divides every config's BLOCK_N / 2)


def config(bm, bn, bk, stages, warps, tma=True, per_sm=1, flatten=True, ws=False) -> triton.Config:
    """tma: load x and weight with the copy engine (persistent grid of per_sm programs per SM)
    or with pointers (one program per tile). flatten / ws: see the tile loop in linear_kernel."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "USE_TMA": tma,
                          "PROGRAMS_PER_SM": per_sm, "FLATTEN": flatten, "WARP_SPECIALIZE": ws},
                         num_stages=stages, num_warps=warps)


# Candidates, from bench/gemm_sweep.py on an H100 (fp16, + bias + GELU):
# - large M: 128x256x64, 8 warps, 4 stages, TMA, persistent: 810-830 us at 4096x4096x16384,
#   with or without warp specialization (ws); two programs per SM measured 980-1140 us, pointer
#   loads 1140-1200 us.
# - M ~ 512: 128x128 tiles (one wave of 128 tiles), BLOCK_K 64 or 128: 32-33 us at 512x4096x4096.
# - M <= 32: the weight is streamed once; 16x32x256 tiles with pointer loads and no flattening
#   10.1 us at 16x4096x4096, TMA 12.5-13.9 us.
# Pointer-load configs stay for operands TMA cannot take (unaligned rows, odd strides).
CONFIGS = [
    config(128, 256, 64, 4, 8), config(128, 256, 64, 4, 8, ws=True), config(128, 256, 64, 3, 8),
    config(128, 128, 128, 3, 8, ws=True), config(128, 128, 64, 4, 8), config(64, 128, 64, 4, 4),
    config(128, 128, 64, 4, 8, tma=False), config(64, 128, 64, 4, 4, tma=False),
    config(32, 64, 128, 4, 4), config(32, 64, 128, 4, 4, tma=False),
    config(16, 32, 256, 3, 4, tma=False, flatten=False), config(16, 32, 256, 4, 4),
    config(16, 64, 128, 4, 4, tma=False),
]
# Narrow or shallow tiles for many rows over few output channels or a short K: the pointwise
# convs of MobileNet / EfficientNet (K 16-32 in, N 16-96 out, ~10^5 rows) are memory-bound, and a
# 128 x 256 x 64 tile there mostly multiplies and stores padding. Offered only where N or K is
# that small (prune_configs).
FIT_CONFIGS = [
    config(128, 32, 64, 4, 4), config(128, 64, 64, 4, 4), config(256, 64, 64, 3, 8),
    config(128, 32, 32, 4, 4), config(128, 64, 32, 4, 4), config(128, 128, 32, 3, 4), config(256, 128, 32, 3, 8),
    config(128, 64, 16, 4, 4), config(128, 128, 16, 3, 4), config(256, 128, 16, 3, 8),
]
CONFIGS += FIT_CONFIGS


def gluon_config(bm, bn, bk, stages, consumers, warps) -> triton.Config:
    """A candidate of the warp-specialized Gluon kernel (kernels/gemm_hopper.py, sm90 only): tiles,
    ring depth (STAGES), MMA warpgroups (CONSUMERS; num_warps is the first one's). The load warp takes
    a warpgroup of its own, so 12 warps hold the SM's 64K registers at 168 a thread (maxnreg); the
    launcher moves them to the MMA warps (232) from the load warp (40) with setmaxnreg."""
    total = (4 * consumers if consumers > 1 else warps) + 4
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "USE_TMA": True,
                          "PROGRAMS_PER_SM": 1, "GLUON": True, "STAGES": stages, "CONSUMERS": consumers},
                         num_warps=warps, num_stages=1, maxnreg=168 if total > 8 else None)


# The Gluon candidates (sm90): two consumers of 128 x 128 tiles in ping-pong (CUTLASS's default fp16
# schedule on H100), one 8-warp consumer of 128 x 256 / 256 x 128, and narrower tiles (tile sides
# are powers of two: 128 x 192, one wave for N = 768 layers, does not build). On an H100 at 4096 x 4096 x
# 16384 the 128 x 256 one ran about 6% ahead of cuBLAS, ping-pong 128 x 128 within 2% of it, 64 x 256
# ping-pong about 11% behind.
GLUON_CONFIGS = [
    gluon_config(128, 128, 64, 4, 2, 4), gluon_config(128, 256, 64, 3, 1, 8), gluon_config(64, 256, 64, 4, 2, 4),
    gluon_config(128, 128, 64, 5, 1, 8), gluon_config(128, 64, 64, 6, 2, 4), gluon_config(256, 128, 64, 3, 1, 8),
]


def coop_config(wgs, bn1, bn2, bk, stages) -> triton.Config:
    """A candidate of gemm_hopper.linear_coop_kernel: 64 * wgs rows by bn1 + bn2 columns, wgs MMA
    warpgroups on one tile and a load warpgroup; registers moved from the load warps to the MMA warps
    (setmaxnreg) within the SM's 64K: 12 warps at 168 (232 / 40), 16 warps at 128 (152 / 56)."""
    return triton.Config({"BLOCK_M": 64 * wgs, "BLOCK_N": bn1 + bn2, "BLOCK_K": bk, "GROUP_M": 8, "USE_TMA": True,
                          "PROGRAMS_PER_SM": 1, "GLUON": True, "COOP": True, "BN1": bn1, "BN2": bn2, "WGS": wgs,
                          "STAGES": stages, "CONSUMERS": wgs,
                          "MMA_REGS": 232 if wgs == 2 else 152, "LOAD_REGS": 40 if wgs == 2 else 56},
                         num_warps=4, num_stages=1, maxnreg=168 if wgs == 2 else 128)


# cuBLAS's one-wave tiles (nvjet, H100): 192 x 192 makes
# 6304 x 768 exactly 132 tiles (ViT-B at batch 32), 192 x 96 makes 3072 x 768 128 tiles (BERT-base 8 x 384)
# and 6272 x 384 132 (ConvNeXt-T); 128 x 192 for GPT-2's 4096 x 768 layers. 192 x 192 runs 32 deep in six
# slots (the same bytes as three of 64; a slot comes back sooner): ViT-B's qkv 39.1 us timed alone (64 deep:
# 39.9), fc2 + residual 48.8 (53.0), on an H100, where each of these three was the fastest Gluon candidate
# at two to four of 20 model layers. Measured and dropped: 192 x 192 64 deep and
# 192 x 128 (the fastest at none; each candidate costs compile and tuning time at every shape); 192 x 96 32
# deep in ten slots (slower than 64 deep everywhere); the epilogue stored from registers, its shared memory
# given to the ring as one more slot (slower at every layer, 1.8x at BERT's query: the stores 16 bytes a
# row a warp).
GLUON_COOP_CONFIGS = [
    coop_config(3, 64, 32, 64, 5), coop_config(2, 128, 64, 64, 4), coop_config(3, 128, 64, 32, 6),
]
GLUON_CONFIGS += GLUON_COOP_CONFIGS
CONFIGS += GLUON_CONFIGS


def gemv_config(bm, bn, bk, warps, flat=False) -> triton.Config:
    """A candidate of gemv_kernel: BLOCK_M rows (M's next power of two, at most GEMV_MAX_M) by
    BLOCK_N channels, BLOCK_K deep; its fp32 accumulator holds BLOCK_M x BLOCK_N x BLOCK_K values,
    32-64 a thread in these. flat: gemv_row's layout (one row)."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "USE_TMA": False,
                          "PROGRAMS_PER_SM": 1, "GEMV": True, **({"FLAT": True} if flat else {})},
                         num_warps=warps, num_stages=1)


GEMV_MAX_M = 8   # rows up to which gemv_kernel's candidates race the tensor-core tiles
# Narrow and deep for (N, K) weights (K contiguous: 16-byte loads along K), wide and shallow for
# weights read as (K, N) (GPT-2's Conv1D: contiguous along N); BLOCK_N >= 32 for gated weights.
GEMV_CONFIGS = [
    gemv_config(1, 4, 1024, 4), gemv_config(1, 8, 512, 4), gemv_config(1, 8, 1024, 8), gemv_config(1, 16, 256, 4),
    gemv_config(1, 32, 256, 4), gemv_config(1, 32, 128, 4), gemv_config(1, 64, 64, 4), gemv_config(1, 128, 32, 4),
    gemv_config(2, 8, 512, 8), gemv_config(2, 16, 256, 4), gemv_config(2, 32, 128, 4), gemv_config(2, 64, 64, 4),
    gemv_config(4, 8, 256, 4), gemv_config(4, 16, 128, 4), gemv_config(4, 32, 64, 4), gemv_config(4, 32, 128, 8),
    gemv_config(8, 8, 128, 4), gemv_config(8, 16, 64, 4), gemv_config(8, 32, 64, 8), gemv_config(8, 32, 32, 4),
]
# One row (a batch-1 decode step) in gemv_row's layout, whose K loop holds no shared memory and no
# barrier (ptxas, sm_90, triton 3.6: the candidates above store and re-read their weight block
# through shared memory every K block); the same tile shapes, raced against them. Not yet timed
# on a GPU alone (the race picks whichever is faster per shape).
GEMV_FLAT_CONFIGS = [
    gemv_config(1, 4, 1024, 4, flat=True), gemv_config(1, 8, 512, 4, flat=True),
    gemv_config(1, 8, 1024, 8, flat=True), gemv_config(1, 16, 256, 4, flat=True),
    gemv_config(1, 32, 256, 4, flat=True), gemv_config(1, 32, 128, 4, flat=True),
    gemv_config(1, 128, 32, 4, flat=True),
]
GEMV_CONFIGS += GEMV_FLAT_CONFIGS
CONFIGS += GEMV_CONFIGS
# Twice as deep (or wide) for int8 weights (weight-only int8): a program of the fp16 candidates
# above has half the bytes in flight when its weight is int8, and those ran at 35-60% of the copy
# bandwidth where fp16 ran at 65-110% (decode on an H100). The same 64 fp32
# accumulators a thread; offered only for int8 weights (prune_configs).
GEMV_INT8_CONFIGS = [
    gemv_config(1, 4, 2048, 4), gemv_config(1, 8, 1024, 4), gemv_config(1, 8, 2048, 8), gemv_config(1, 16, 512, 4),
    gemv_config(1, 32, 512, 8), gemv_config(1, 64, 256, 8), gemv_config(2, 8, 1024, 8), gemv_config(2, 16, 512, 8),
    gemv_config(2, 32, 256, 8), gemv_config(4, 8, 512, 8), gemv_config(4, 16, 256, 8), gemv_config(4, 32, 128, 8),
    gemv_config(8, 8, 256, 8), gemv_config(8, 16, 128, 8), gemv_config(8, 32, 64, 8),
    gemv_config(1, 4, 2048, 4, flat=True), gemv_config(1, 8, 1024, 4, flat=True), gemv_config(1, 8, 2048, 8, flat=True),
    gemv_config(1, 16, 512, 4, flat=True), gemv_config(1, 32, 256, 4, flat=True), gemv_config(1, 32, 512, 8, flat=True),
]
# the int8 candidates that no float one already is (three are the same launch as a float candidate: kept
# once, offered to every call; membership by identity, as triton.Config's equality differs by version: on
# triton 3.6 it compared values, and those three were never offered to a float call)
GEMV_INT8_ONLY = [c for c in GEMV_INT8_CONFIGS if all(config_dict(c) != config_dict(f) for f in GEMV_CONFIGS)]
CONFIGS += GEMV_INT8_ONLY
_INT8_ONLY = {id(c) for c in GEMV_INT8_ONLY}
_FIT = {id(c) for c in FIT_CONFIGS}


def prune_configs(configs, sizes):
    """Only tiles whose height suits M (tall tiles on tiny M compute padding, short ones on
    large M re-read the weight too often), no wider than N and no deeper than K need (rounded up
    to a power of two, at least 16), narrow or shallow ones (FIT_CONFIGS) only where N or K is
    small, and TMA configs only where the operands allow it. Never empty: the default config
    stands in when nothing fits."""
    m = sizes["M"]
    n_fit = max(16, triton.next_power_of_2(max(1, sizes["N"])))
    k_fit = max(16, triton.next_power_of_2(max(1, sizes["K"])))
    gemv = [c for c in configs if c.kwargs.get("GEMV")]
    configs = [c for c in configs if not c.kwargs.get("GEMV")]
    if m <= GEMV_MAX_M and sizes.get("gemv", True):
        # the rows' own power of two; gated tiles pair GATE_GROUP gate and up columns
        gemv = [c for c in gemv if c.kwargs["BLOCK_M"] == triton.next_power_of_2(max(1, m))
                and (not sizes.get("gated") or c.kwargs["BLOCK_N"] >= 2 * GATE_GROUP)
                and (id(c) not in _INT8_ONLY or sizes.get("w8"))]
        if sizes.get("norm"):    # a norm before the projection: gemv_kernel's K loop takes it, no tile does
            return gemv or [interpreter_config(sizes)]
        configs += gemv
    if m <= 32:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] <= 32]
    elif m <= 128:
        keep = [c for c in configs if 32 <= c.kwargs["BLOCK_M"] <= 128]
    else:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] >= 64]
    small = n_fit < 128 or k_fit < 64
    keep = [c for c in keep if (id(c) not in _FIT or small)
            and c.kwargs["BLOCK_N"] <= max(n_fit, 32) and c.kwargs["BLOCK_K"] <= k_fit]
    if not sizes["tma"]:
        keep = [c for c in keep if not c.kwargs["USE_TMA"]]
    if not sizes.get("gluon"):
        keep = [c for c in keep if not c.kwargs.get("GLUON")]
    return keep or [default_config(sizes)]


def default_config(sizes) -> triton.Config:
    """The config used without tuning (ACCELC_AUTOTUNE=0): modest tiles that fit in shared
    memory for every dtype (gemv_kernel's where a norm comes before the projection: only it takes one)."""
    if sizes.get("norm"):
        return interpreter_config(sizes)
    if sizes["M"] <= 32:
        return config(16, 32, 256, 3, 4, tma=False, flatten=False)
    return config(64, 128, 64, 3 if sizes["dtype"] == torch.float32 else 4, 4, tma=sizes["tma"])


def interpreter_config(sizes) -> triton.Config:
    """The interpreter has no device to time configs on; its time goes by programs and K steps, not
    by their size. gemv_kernel's for a few rows, so that the CPU tests' decode steps run it (128
    channels a program, 64 deep; every gemv candidate's own test covers several programs along N);
    else tiles of 32, or 64 along a dim of 64 or more (a whole model's layers: fewer programs and
    steps; the GEMM tests' small shapes keep several 32-tiles and their tails)."""
    if sizes["M"] <= GEMV_MAX_M and sizes.get("gemv", True):
        return gemv_config(triton.next_power_of_2(max(1, sizes["M"])), 128, 64, 4)
    bm, bn, bk = (64 if sizes[d] >= 64 else 32 for d in ("M", "N", "K"))
    return config(bm, bn, bk, 1, 4, tma=sizes["tma"])
