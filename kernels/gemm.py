"""accelc::linear — a Triton GEMM with the fused epilogue of kernels/epilogue.py.

For x (..., K), weight (N, K) as nn.Linear stores it, optional bias (N,) and residual (..., N):

    out = act(x @ weight^T + bias) + residual        residual_first=False (x + fc2(...))
    out = act(x @ weight^T + bias + residual)        residual_first=True  (relu(fc(x) + x))

in x's dtype (fp16, bf16, fp32), accumulating in fp32. fp32 inputs use true fp32 products
unless allow_tf32 (tensor cores, ~1e-3 relative error), as PyTorch's own default.

The kernel is the blocked GEMM of Triton's tutorial 03-matrix-multiplication: one program per
BLOCK_M x BLOCK_N output tile, K walked in BLOCK_K steps that the compiler software-pipelines
(num_stages), programs ordered in groups of GROUP_M tile rows so that the weight tiles they
share stay in L2. Rows past M and columns past N are wrapped (modulo) for the loads, so only
the K tail needs a mask, and the final store is masked. The weight is read through its strides,
so weight.t() views (matmul(x, W) written as a Linear) cost no copy.

The family's rooms: the kernels and their launch here; the candidates the tuner races and their pruning in
kernels/gemm_configs.py (also read as gemm.<name>); the Gluon kernels in kernels/gemm_hopper.py; what it shares
with conv and attention (tile order, SM count, TMA views) in kernels/primitives.py.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from accelc import runtime
from accelc.kernels.epilogue import (ACTIVATION_NAMES, ACTIVATIONS, activation_code, apply_activation,
                                     broadcasts_to, epilogue, epilogue_ref, residual_as)
from accelc.kernels.pdl import enabled as pdl_enabled, prefetch_rows, prefetching, wait_for_producers
from accelc.kernels.primitives import sm_count, tile_coords, tma_ok
# the family's candidates (kernels/gemm_configs.py), also read as gemm.<name> by its callers
from accelc.kernels.gemm_configs import (CONFIGS, FIT_CONFIGS, GATE_GROUP, GEMV_CONFIGS, GEMV_FLAT_CONFIGS,  # noqa: F401
                                         GEMV_INT8_CONFIGS, GEMV_INT8_ONLY, GEMV_MAX_M, GLUON_CONFIGS,
                                         GLUON_COOP_CONFIGS, config, coop_config, default_config, gemv_config,
                                         gluon_config, interpreter_config, prune_configs)
from accelc.tuning import CompiledCall, Tuner, check_once
from accelc.compile_ahead import launch_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_GATE_GROUP = tl.constexpr(GATE_GROUP)   # the same, as the kernels see it


@triton.jit
def gated_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile over interleaved [gate GATE_GROUP | up GATE_GROUP] column blocks -> (gate, up), each
    (BLOCK_M, BLOCK_N // 2) in output-column order."""
    a = tl.reshape(acc, (BLOCK_M, BLOCK_N // (2 * _GATE_GROUP), 2, _GATE_GROUP))
    a = tl.reshape(tl.permute(a, (0, 1, 3, 2)), (BLOCK_M, BLOCK_N // 2, 2))
    return tl.split(a)


@triton.jit(do_not_specialize=["M"])  # sizes that follow the batch or length: one binary for every size
def linear_kernel(
    # pointers (x_desc / w_desc: TMA descriptors of x and weight when USE_TMA; with W_T, w_desc
    # is the descriptor of weight^T, a row-major (K, N))
    x_ptr, w_ptr, x_desc, w_desc, bias_ptr, res_ptr, out_ptr, a_scale_ptr, w_scale_ptr,
    # sizes (N: the weight's rows; N_OUT: the output's columns, N / 2 rounded down to GATE_GROUP when GATED)
    M, N, K, N_OUT,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on,
    # epilogue
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RESIDUAL_FIRST: tl.constexpr,
    ACTIVATION: tl.constexpr,
    # QUANT: the call's Mode (below), as its int: 0 float operands; 3 float x and an int8 weight (the
    # weight tile converted to x's dtype before the dot, exact for -127..127, the product scaled by w_scale
    # per output channel); 1 int8 operands, int32 accumulators dequantized by a_scale (per row of x) x
    # w_scale (per output channel) before the epilogue; 2 int8, raw int32 stored; 4 fp8 (e4m3) operands,
    # fp32 accumulators dequantized as 1's
    QUANT: tl.constexpr, FAST_MATH: tl.constexpr,
    # GATED: the weight holds a gated MLP's gate and up rows interleaved in GATE_GROUP blocks
    # (kernels/gated_linear.py); the epilogue writes act(gate) * up, half the tile's columns
    GATED: tl.constexpr,
    # meta-parameters
    USE_TMA: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    EVEN_K: tl.constexpr, W_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    # PROGRAMS_PER_SM only sizes the persistent grid (launcher).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    # Persistent: each program walks tiles start, start + num_programs, ...; FLATTEN lets the
    # pipeliner issue the next tile's loads during this tile's epilogue; WARP_SPECIALIZE gives
    # the loads to a producer warp so the epilogue overlaps the next tile's tensor-core loop.
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if QUANT == 1 or QUANT == 2:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            if USE_TMA:
                # the copy engine zero-fills rows, columns and K past the tensor's edge
                a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
                if W_T:   # the weight is the transpose of a row-major (K, N): x @ W, GPT-2's Conv1D
                    b = w_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
                else:
                    b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            else:
                # wrapped row/column indices stay in bounds; the masked store drops them
                rows = offs_m % M
                cols = offs_n % N
                x_ptrs = x_ptr + rows[:, None] * stride_xm + (k * BLOCK_K + offs_k)[None, :] * stride_xk
                w_ptrs = w_ptr + (k * BLOCK_K + offs_k)[:, None] * stride_wk + cols[None, :] * stride_wn
                if EVEN_K:
                    a = tl.load(x_ptrs)
                    b = tl.load(w_ptrs)
                else:
                    k_left = K - k * BLOCK_K
                    a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                    b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            if DOT_IN_FP32:
                # Triton's CPU interpreter multiplies bf16 operands wrongly in tl.dot; bf16 -> fp32
                # is exact, so the products and fp32 sums are the same as the tensor cores'.
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if QUANT == 3:
                b = b.to(a.dtype)
            if QUANT == 1 or QUANT == 2:
                acc = tl.dot(a, b, acc, out_dtype=tl.int32)   # (triton 3.6 wants out_dtype said)
            elif QUANT == 4:
                acc = tl.dot(a, b, acc)
            else:
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

        if QUANT == 1 or QUANT == 4:
            a_s = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
            w_s = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc.to(tl.float32) * a_s[:, None] * w_s[None, :]
        if QUANT == 3:
            acc = acc * tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        # (a TMA store of the tile measured slower than this one on H100: 858 vs 830 us at
        # 4096x4096x16384, bench/gemm_sweep.py)
        store_tile(acc, offs_m, offs_n, pid_n, M, N, N_OUT, bias_ptr, res_ptr, out_ptr,
                   stride_rm, stride_rn, stride_om, stride_on, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST,
                   ACTIVATION, FAST_MATH, GATED, QUANT == 2, BLOCK_M, BLOCK_N)


@triton.jit
def store_tile(acc, offs_m, offs_n, pid_n, M, N, N_OUT, bias_ptr, res_ptr, out_ptr,
               stride_rm, stride_rn, stride_om, stride_on,
               HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RESIDUAL_FIRST: tl.constexpr,
               ACTIVATION: tl.constexpr, FAST_MATH: tl.constexpr, GATED: tl.constexpr, RAW: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The epilogue and store of an accumulator tile (linear_kernel's and gemv_kernel's) of rows
    offs_m and weight rows offs_n: GATED, act(gate + bias) * (up + bias) into half the columns;
    else bias, activation and residual (kernels/epilogue.py); RAW, the accumulators as they are
    (int8 GEMMs' int32)."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if GATED:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        gate, up = gated_halves(acc, BLOCK_M, BLOCK_N)
        acc = apply_activation(gate, ACTIVATION, FAST_MATH) * up
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N_OUT)
    elif not RAW:
        res_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :] * stride_rn
        acc = epilogue(acc, bias_ptr, res_ptrs, mask, offs_n, N,
                       HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, FAST_MATH)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def k_block(x_ptrs, w_ptrs, in_k, EVEN_K: tl.constexpr):
    """The x and weight values of one K block of the GEMV loops (in_k: which of its K offsets exist)."""
    if EVEN_K:
        a = tl.load(x_ptrs)
        b = tl.load(w_ptrs)
    else:
        a = tl.load(x_ptrs, mask=in_k, other=0.0)
        b = tl.load(w_ptrs, mask=in_k, other=0.0)
    return a, b


@triton.jit
def weight_f32(b, W_SCALED: tl.constexpr):
    """A GEMV's weight block in fp32. An int8 one (W_SCALED) without the int-to-float conversion
    instruction, which an SM issues at an eighth of its FMA rate (sm_90: 16 a clock), where a
    weight-only int8 GEMV converts one a weight: the byte v + 128 (v's bits with the top one
    flipped) as the low mantissa bits of 2^23 is the float 2^23 + v + 128, exactly; one XOR puts
    it there (0x4B000000: 2^23's bits), one add takes 2^23 + 128 away, exactly. An fp8 (e4m3) weight
    (weight-only fp8, kernels/fp8_weight.py) converts as it is."""
    if W_SCALED and not tl.constexpr(b.dtype.is_fp8()):
        bits = b.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x4B000080
        return bits.to(tl.float32, bitcast=True) - 8388736.0
    else:
        return b.to(tl.float32)


@triton.jit(do_not_specialize=["M"])  # sizes that follow the batch or length: one binary for every size
def gemv_kernel(
    x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, w_scale_ptr, M, N, K, N_OUT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on, norm_ptr, norm_eps,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RESIDUAL_FIRST: tl.constexpr, ACTIVATION: tl.constexpr,
    FAST_MATH: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr, W_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    FLAT: tl.constexpr = False, NORM: tl.constexpr = False, PREFETCH: tl.constexpr = False,
):
    """linear_kernel's op for a few rows (a decode step's M = 1-8): memory-bound, so no tensor
    cores and no tiles of padding rows. One program per BLOCK_N output channels (x BLOCK_M rows)
    streams its BLOCK_N weight rows once, BLOCK_K at a time, multiplying on the CUDA cores into
    an fp32 (BLOCK_M, BLOCK_N, BLOCK_K) accumulator that is summed over K once, after the loop
    (no cross-thread reduction per step); many narrow programs keep every SM's loads in flight.
    Same epilogue (bias, activation, residual, gating) and wrapped-index loads as linear_kernel;
    W_SCALED: an int8 weight (weight-only int8), its products scaled by w_scale per channel.
    PDL (kernels/pdl.py): the first weight block is loaded before waiting for the kernel that
    writes x, the rest after; PREFETCH: the rest asked of L2 before the wait too (pdl.prefetch_rows). FLAT (one row, BLOCK_M = 1): see gemv_row. NORM: x's rows first
    RMS-normalized (weight norm_ptr (K,), eps norm_eps), the norm before the projection as one kernel:
    each x value times its norm weight on load, the row's sum of squares taken in the same K loop, the
    products scaled by rsqrt(mean + eps) at the end (linear_launch's norm_weight / norm_eps)."""
    if FLAT:
        gemv_row(x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, w_scale_ptr, M, N, K, N_OUT,
                 stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on,
                 norm_ptr, norm_eps,
                 HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, FAST_MATH, GATED, EVEN_K, W_SCALED,
                 BLOCK_N, BLOCK_K, PDL, NORM, PREFETCH)
        return
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m % M
    cols = offs_n % N
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + cols[:, None] * stride_wn + offs_k[None, :] * stride_wk
    # the first K block peeled: its weights read before waiting for x's producer (PDL)
    b = tl.load(w_ptrs, mask=offs_k[None, :] < K, other=0.0)
    if PREFETCH:
        prefetch_rows(w_ptr, cols, stride_wn, stride_wk, K, BLOCK_K)
    wait_for_producers(PDL)
    a = tl.load(x_ptrs, mask=offs_k[None, :] < K, other=0.0).to(tl.float32)
    if NORM:
        ss = a * a                                                 # (the rows' squares, summed after the loop)
        a = a * tl.load(norm_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]
    acc3 = a[:, None, :] * weight_f32(b, W_SCALED)[None, :, :]
    x_ptrs += BLOCK_K * stride_xk
    w_ptrs += BLOCK_K * stride_wk
    for k in range(BLOCK_K, K, BLOCK_K):
        a, b = k_block(x_ptrs, w_ptrs, offs_k[None, :] < K - k, EVEN_K)
        a = a.to(tl.float32)
        if NORM:
            ss += a * a
            a = a * tl.load(norm_ptr + k + offs_k, mask=offs_k < K - k, other=0.0).to(tl.float32)[None, :]
        acc3 += a[:, None, :] * weight_f32(b, W_SCALED)[None, :, :]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    acc = tl.sum(acc3, axis=2)
    if W_SCALED:
        acc = acc * tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if NORM:
        acc = acc * tl.rsqrt(tl.sum(ss, axis=1) / K + norm_eps)[:, None]
    store_tile(acc, offs_m, offs_n, pid_n, M, N, N_OUT, bias_ptr, res_ptr, out_ptr,
               stride_rm, stride_rn, stride_om, stride_on, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST,
               ACTIVATION, FAST_MATH, GATED, False, BLOCK_M, BLOCK_N)


@triton.jit
def gemv_row(
    x_ptr, w_ptr, bias_ptr, res_ptr, out_ptr, w_scale_ptr, M, N, K, N_OUT,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_rn, stride_om, stride_on, norm_ptr, norm_eps,
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RESIDUAL_FIRST: tl.constexpr, ACTIVATION: tl.constexpr,
    FAST_MATH: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr, W_SCALED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, NORM: tl.constexpr, PREFETCH: tl.constexpr,
):
    """gemv_kernel for one row of x (program (pid_n, row)) in the weight block's own layout: a
    (BLOCK_N, BLOCK_K) accumulator, and x's BLOCK_K values loaded through pointers broadcast over
    the block's rows, so that each thread loads the x values its weights meet (from L1: one row of
    x is read by every program). gemv_kernel's (BLOCK_M, BLOCK_N, BLOCK_K) product has loads in
    2-D layouts that it moves into slices of its 3-D one through shared memory, with barriers,
    every K block (ptxas for sm_90, triton 3.6: the weight block stored and re-read each step);
    here the loop holds no shared memory and no barrier, only the loads, conversions and FMAs."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    cols = offs_n % N
    x_ptrs = tl.broadcast_to(x_ptr + row * stride_xm + offs_k[None, :] * stride_xk, (BLOCK_N, BLOCK_K))
    # the same K offsets, known contiguous in runs of 8 only: an int8 weight is then loaded 8 bytes a
    # thread, in x's layout (8 halves, 16 bytes), where 16-byte loads would give it a layout of its
    # own and x's values would move into it through shared memory every K block
    w_k = (offs_k // 8) * 8 + offs_k % 8 if W_SCALED else offs_k
    w_ptrs = w_ptr + cols[:, None] * stride_wn + w_k[None, :] * stride_wk
    b = tl.load(w_ptrs, mask=offs_k[None, :] < K, other=0.0)     # before waiting for x's producer (PDL)
    if NORM:    # (the norm weight, in x's layout as x's values: a constant, read before the wait too)
        n_ptrs = tl.broadcast_to(norm_ptr + offs_k[None, :], (BLOCK_N, BLOCK_K))
        nw = tl.load(n_ptrs, mask=offs_k[None, :] < K, other=0.0).to(tl.float32)
        x_row = x_ptr + row * stride_xm + offs_k * stride_xk      # x's row once a block, for its squares
    if PREFETCH:
        prefetch_rows(w_ptr, cols, stride_wn, stride_wk, K, BLOCK_K)
    wait_for_producers(PDL)
    a = tl.load(x_ptrs, mask=offs_k[None, :] < K, other=0.0).to(tl.float32)
    if NORM:
        # the squares from one read of the row a block, not from the block's broadcast copy of it (a sum per
        # output row of the block, each the same)
        xs = tl.load(x_row, mask=offs_k < K, other=0.0).to(tl.float32)
        ss = xs * xs
        a = a * nw
    acc = a * weight_f32(b, W_SCALED)
    x_ptrs += BLOCK_K * stride_xk
    w_ptrs += BLOCK_K * stride_wk
    for k in range(BLOCK_K, K, BLOCK_K):
        a, b = k_block(x_ptrs, w_ptrs, offs_k[None, :] < K - k, EVEN_K)
        a = a.to(tl.float32)
        if NORM:
            x_row += BLOCK_K * stride_xk
            n_ptrs += BLOCK_K
            if EVEN_K:      # (unmasked, as k_block's: the broadcast norm weight's loads and conversions then
                xs = tl.load(x_row).to(tl.float32)      # shared by a thread's rows)
                nwk = tl.load(n_ptrs)
            else:
                xs = tl.load(x_row, mask=offs_k < K - k, other=0.0).to(tl.float32)
                nwk = tl.load(n_ptrs, mask=offs_k[None, :] < K - k, other=0.0)
            ss += xs * xs
            a = a * nwk.to(tl.float32)
        acc += a * weight_f32(b, W_SCALED)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out = tl.sum(acc, axis=1)[None, :]
    if W_SCALED:
        out = out * tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if NORM:
        out = out * tl.rsqrt(tl.sum(ss, axis=0) / K + norm_eps)
    store_tile(out, row + tl.arange(0, 1), offs_n, pid_n, M, N, N_OUT, bias_ptr, res_ptr, out_ptr,
               stride_rm, stride_rn, stride_om, stride_on, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST,
               ACTIVATION, FAST_MATH, GATED, False, 1, BLOCK_N)


TUNER = Tuner("linear", linear_kernel, CONFIGS, prune=prune_configs, default=default_config,
              interpreter=interpreter_config, other_kernels=lambda: other_kernels())


def weight_by_columns(weight: torch.Tensor) -> bool:
    """The (N, K) weight is the transpose of a row-major (K, N) the copy engine can load (x @ W with
    W stored (in, out), as GPT-2's Conv1D and written matmuls keep it): the kernel loads (K, N)
    boxes of weight^T (W_T) instead of (N, K) boxes of weight."""
    return not tma_ok(weight) and tma_ok(weight.t())


def epilogue_problem(x, N, bias, residual, activation) -> str | None:
    """What is wrong with a GEMM-shaped op's epilogue operands (bias (N,), residual shaped as the
    output (..., N), both x's dtype and device), or None."""
    out_shape = (*x.shape[:-1], N)
    for name, t in (("bias", bias), ("residual", residual)):
        if t is not None and t.dtype != x.dtype:
            return f"{name} is {t.dtype} but x is {x.dtype}"
        if t is not None and t.device != x.device:
            return f"{name} is on {t.device} but x is on {x.device}"
    if bias is not None and tuple(bias.shape) != (N,):
        return f"bias must be ({N},), got {tuple(bias.shape)}"
    if residual is not None and not broadcasts_to(residual, out_shape):
        return f"residual {tuple(residual.shape)} does not broadcast to the output's shape {out_shape}"
    if activation not in ACTIVATIONS:
        return f"activation must be one of {ACTIVATION_NAMES}, not {activation!r}"
    return None


def why_unsupported(x, weight, bias=None, residual=None, activation="none") -> str | None:
    """Why accelc::linear cannot take these operands (the caller then stays PyTorch), or None.
    Works on meta tensors: the rules ask it before rewriting."""
    if weight.dim() != 2 or x.dim() < 1:
        return f"weight must be 2-D (N, K) and x at least 1-D (..., K), got {tuple(weight.shape)} and {tuple(x.shape)}"
    K, N = x.shape[-1], weight.shape[0]
    if weight.shape[1] != K:
        return f"x has K={K} features but weight is {tuple(weight.shape)}: expected (N, {K}) as nn.Linear stores it"
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not supported (fp16, bf16, fp32)"
    if weight.dtype != x.dtype:
        return f"weight is {weight.dtype} but x is {x.dtype}"
    if weight.device != x.device:
        return f"weight is on {weight.device} but x is on {x.device}"
    return epilogue_problem(x, N, bias, residual, activation)


class Mode(enum.IntEnum):
    """What a launch of the linear kernels computes (linear_kernel's QUANT, passed as its int: the same
    compiled kernels, the same cache keys)."""
    FLOAT = 0          # float x and weight
    W8A8 = 1           # int8 x and weight, the accumulators dequantized (a_scale x w_scale), half or fp32 out
    W8A8_RAW = 2       # int8 x and weight, the raw int32 accumulators stored
    WEIGHT_INT8 = 3    # float x, a one-byte weight (int8, or fp8 e4m3) scaled per output channel (weight-only)
    FP8 = 4            # fp8 (e4m3) x and weight, the fp32 accumulators dequantized (a_scale x w_scale)

    @staticmethod
    def of(x2: torch.Tensor, out: torch.Tensor, scales) -> "Mode":
        """The mode of a launch(x2, ..., out, scales=...) call (see launch)."""
        if scales is None:
            return Mode.FLOAT
        if out.dtype == torch.int32:
            return Mode.W8A8_RAW
        if x2.dtype == torch.float8_e4m3fn:
            return Mode.FP8
        return Mode.W8A8 if x2.dtype == torch.int8 else Mode.WEIGHT_INT8


_CHECKED: set = set()   # call signatures whose operands why_unsupported accepted


def norm_problem(x, norm_weight, norm_eps) -> str | None:
    """What is wrong with the RMSNorm an op takes before its projection (norm_weight (K,) in x's dtype, a number
    eps), or None; None too where there is no norm (norm_eps None)."""
    if norm_eps is None:
        return None if norm_weight is None else "norm_weight given without norm_eps"
    K = x.shape[-1]
    if norm_weight is None or tuple(norm_weight.shape) != (K,) or norm_weight.dtype != x.dtype \
            or norm_weight.device != x.device:
        got = None if norm_weight is None else (tuple(norm_weight.shape), norm_weight.dtype, norm_weight.device)
        return f"norm_weight must be ({K},) {x.dtype} on {x.device}, got {got}"
    return None


def normed_rows(x2, norm_weight, norm_eps):
    """(x2 or its rows RMS-normalized, the norm launch takes in its K loop or None): rows up to GEMV_MAX_M go
    normalized inside gemv_kernel; more rows through the norm kernel first (kernels/layernorm.py)."""
    if norm_eps is None:
        return x2, None
    if x2.shape[0] <= GEMV_MAX_M:
        return x2, (norm_weight, float(norm_eps))
    from accelc.kernels.layernorm import rms_norm_launch
    return rms_norm_launch(x2, norm_weight, None, float(norm_eps)), None


def rms_normed_ref(x, norm_weight, norm_eps, acc_dtype):
    """x in acc_dtype, RMS-normalized where norm_eps is given (the statistics and the weight in acc_dtype)."""
    h = x.to(acc_dtype)
    if norm_eps is None:
        return h
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm_eps) * norm_weight.to(acc_dtype)


def linear_launch(x, weight, bias=None, residual=None, activation="none",
                  residual_first=False, allow_tf32=False, norm_weight=None, norm_eps=None):
    """Checks, allocates, launches. Shapes: x (..., K), weight (N, K) (any strides),
    bias (N,), residual (..., N). Returns (..., N) in x.dtype. norm_weight (K,) and norm_eps: x's rows
    RMS-normalized first (the norm before a projection: normed_rows)."""
    sig = (x.shape, x.dtype, x.device, weight.shape, weight.dtype, weight.device,
           None if bias is None else (bias.shape, bias.dtype, bias.device),
           None if residual is None else (residual.shape, residual.dtype, residual.device), activation,
           norm_eps is None)
    check_once(_CHECKED, sig, lambda: why_unsupported(x, weight, bias, residual, activation)
               or norm_problem(x, norm_weight, norm_eps), "linear")
    K, N = x.shape[-1], weight.shape[0]
    residual = residual_as(residual, (*x.shape[:-1], N))
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M > 0 and N > 0:
        res2 = residual.reshape(M, N) if residual is not None else None
        x2, norm = normed_rows(x2, norm_weight, norm_eps)
        launch(x2, weight, bias, res2, out, activation, residual_first, allow_tf32, norm=norm)
    return out.reshape(*x.shape[:-1], N)


def launch(x2, weight, bias, res2, out, activation="none", residual_first=False, allow_tf32=False,
           config: triton.Config | None = None, scales=None, tuner: Tuner | None = None, gated: bool = False,
           norm: tuple | None = None):
    """Launch on checked 2-D operands: out (M, N) = epilogue(x2 (M, K) @ weight (N, K)^T).
    `config` overrides the tuner (bench/gemm_sweep.py). For int8 x2 and weight
    (kernels/int8_gemm.py): scales = (a_scale (M,), w_scale (N,)) fp32, and an int32 `out`
    receives the raw accumulators; `tuner` is then the int8 one. For float x2 and an int8 weight
    (weight-only int8, kernels/int8_weight.py): scales = (None, w_scale (N,) fp32). gated: weight (and bias) hold
    gate and up rows interleaved (kernels/gated_linear.py), out (M, N_OUT) = act(gate) * up, and
    `tuner` is the gated one. norm = (norm_weight (K,), eps): x2's rows RMS-normalized first, in
    gemv_kernel's K loop (rows up to GEMV_MAX_M: its candidates only; linear_launch runs larger ones as
    the norm kernel and the plain GEMM). A call signature seen before launches its compiled kernel
    directly (accelc.tuning.CompiledCall)."""
    tuner = tuner or TUNER
    a_scale, w_scale = scales if scales is not None else (out, out)
    a_scale = a_scale if a_scale is not None else out
    res = res2 if res2 is not None else out
    tensors = (x2, weight, bias if bias is not None else out, res, out, a_scale, w_scale)
    sig = (x2.shape, x2.stride(), weight.shape, weight.stride(), res.stride(), out.stride(), x2.dtype, out.dtype,
           bias is None, res2 is None, scales is None, activation, bool(residual_first), bool(allow_tf32),
           bool(gated), x2.device, tuple(t.data_ptr() % 16 for t in tensors),
           None if norm is None else (norm[0].data_ptr() % 16, norm[0].dtype))   # (eps: an argument)
    if norm is not None:
        tensors += (norm[0], float(norm[1]))
    known = tuner.calls.get(sig) if config is None else None
    with runtime.device_guard(x2):
        if known is not None:
            call, kw = known
            call(kernel_args(kw, tensors), x2.device.index or 0)
            return
        lp = LaunchPlan.of(x2, weight, bias, res2, out, activation, residual_first, allow_tf32, scales, gated, norm)

        def run(cfg):
            kw = cfg.all_kwargs()
            lp.refuse(kw)
            kernel, constexprs = lp.kernel(kw)
            launch_kernel(kernel, lp.grid(kw), kernel_args(kw, tensors), constexprs)

        if config is not None:
            run(config)
            return
        cfg = tuner.pick(lp.tuning_key(), lp.problem(), run)
        kw = cfg.all_kwargs()
        kernel, constexprs = lp.kernel(kw)
        tuner.calls[sig] = (CompiledCall(kernel, lp.grid(kw), kernel_args(kw, tensors), constexprs), kw)


@dataclasses.dataclass
class LaunchPlan:
    """What a linear call's operands decide for every config of it: the problem's sizes, its call mode, whether TMA
    and the Gluon kernels can take it, the epilogue's constexprs (meta); per config, the kernel and grid."""
    M: int
    N: int
    K: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    mode: Mode
    use_tma: bool
    gluon: bool
    gated: bool
    norm: bool
    pdl: bool
    sms: int | None
    meta: dict
    prefetch: bool = False     # the GEMV's weights asked of L2 before its dependent-launch wait (pdl.prefetching)

    @classmethod
    def of(cls, x2, weight, bias, res2, out, activation, residual_first, allow_tf32, scales, gated,
           norm) -> LaunchPlan:
        M, K = x2.shape
        mode = Mode.of(x2, out, scales)
        w_t = weight_by_columns(weight)
        use_tma = K > 0 and tma_ok(x2) and (tma_ok(weight) or w_t)
        meta = dict(
            HAS_BIAS=bias is not None, HAS_RESIDUAL=res2 is not None,
            RESIDUAL_FIRST=bool(residual_first), ACTIVATION=activation_code(activation), QUANT=int(mode),
            GATED=bool(gated), W_T=use_tma and w_t,
            # int8 layers with half outputs: GELU on the SFU's tanh (kernels/epilogue.py)
            FAST_MATH=mode is Mode.W8A8 and out.dtype in (torch.float16, torch.bfloat16),
            INPUT_PRECISION="tf32" if (allow_tf32 and x2.dtype == torch.float32) else "ieee",
            DOT_IN_FP32=runtime.interpreted() and x2.dtype == torch.bfloat16,
        )
        # the Gluon kernels: float GEMMs, and W8A8's linear_ws_kernel (int8 or fp8 (N, K) weight, half output)
        gluon = (mode is Mode.FLOAT or mode in (Mode.W8A8, Mode.FP8) and not meta["W_T"]) and not gated and use_tma \
            and norm is None and gluon_problem(x2, res2, out, mode) is None
        return cls(M, weight.shape[0], K, x2.dtype, out.dtype, mode, use_tma, gluon, bool(gated), norm is not None,
                   pdl_enabled(x2.device), sm_count(x2.device.index or 0) if x2.is_cuda else None, meta,
                   prefetching(x2.device))

    def tuning_key(self) -> tuple:
        """Every batch size of a bucket (next power of two of M) shares one tuning run."""
        return (triton.next_power_of_2(self.M), self.N, self.K, self.use_tma, self.meta["W_T"], self.dtype,
                self.out_dtype) + (("gluon",) if self.gluon else ()) + (("norm",) if self.norm else ())

    def problem(self) -> dict:
        """What the configs' prune reads (kernels/gemm_configs.py)."""
        return dict(M=self.M, N=self.N, K=self.K, tma=self.use_tma, dtype=self.dtype, gluon=self.gluon,
                    gemv=self.mode in (Mode.FLOAT, Mode.WEIGHT_INT8), w8=self.mode is Mode.WEIGHT_INT8,
                    gated=self.gated, norm=self.norm)

    def refuse(self, kw) -> None:
        """A config this call cannot run, refused with its reason (the tuner skips it)."""
        if kw["USE_TMA"] and not self.use_tma or kw.get("GLUON") and not self.gluon:
            raise ValueError("accelc::linear: a TMA config for operands TMA cannot load")
        if kw.get("GEMV") and self.mode not in (Mode.FLOAT, Mode.WEIGHT_INT8):
            raise ValueError("accelc::linear: gemv_kernel takes float x")
        if self.norm and not kw.get("GEMV"):
            raise ValueError("accelc::linear: the norm before the projection runs in gemv_kernel only")

    def grid(self, kw) -> tuple:
        """TMA programs are persistent (PROGRAMS_PER_SM per SM, looping over tiles); pointer programs (and every
        program in the interpreter) take one tile each."""
        if kw.get("GEMV"):
            return (triton.cdiv(self.N, kw["BLOCK_N"]), triton.cdiv(self.M, kw["BLOCK_M"]))
        tiles = triton.cdiv(self.M, kw["BLOCK_M"]) * triton.cdiv(self.N, kw["BLOCK_N"])
        return (min(tiles, self.sms * kw["PROGRAMS_PER_SM"]) if (self.sms and kw["USE_TMA"]) else tiles,)

    def kernel(self, kw) -> tuple:
        """(kernel, its constexprs and launch options) for a config's kwargs."""
        meta = self.meta
        epilogue = dict(HAS_BIAS=meta["HAS_BIAS"], HAS_RESIDUAL=meta["HAS_RESIDUAL"],
                        RESIDUAL_FIRST=meta["RESIDUAL_FIRST"], ACTIVATION=meta["ACTIVATION"])
        if kw.get("GEMV"):
            return gemv_kernel, dict(
                epilogue, FAST_MATH=meta["FAST_MATH"], GATED=meta["GATED"],
                EVEN_K=self.K % kw["BLOCK_K"] == 0, W_SCALED=self.mode is Mode.WEIGHT_INT8, BLOCK_M=kw["BLOCK_M"],
                BLOCK_N=kw["BLOCK_N"], BLOCK_K=kw["BLOCK_K"], num_warps=kw["num_warps"], num_stages=kw["num_stages"],
                FLAT=kw.get("FLAT", False), NORM=self.norm,
                **({"PDL": True, "launch_pdl": True, "PREFETCH": self.prefetch} if self.pdl else {}))
        if kw.get("COOP"):
            return _hopper().linear_coop_kernel, dict(
                epilogue, W_T=meta["W_T"], BN2=kw["BN2"], WGS=kw["WGS"], STAGES=kw["STAGES"],
                GROUP_M=kw["GROUP_M"], LOAD_REGS=kw["LOAD_REGS"], MMA_REGS=kw["MMA_REGS"],
                num_warps=kw["num_warps"], maxnreg=kw.get("maxnreg"))
        if kw.get("GLUON"):
            return _hopper().linear_ws_kernel, dict(
                epilogue, QUANT={Mode.W8A8: 1, Mode.FP8: 2}.get(self.mode, 0), W_T=meta["W_T"], STAGES=kw["STAGES"],
                GROUP_M=kw["GROUP_M"], CONSUMERS=kw["CONSUMERS"], LOAD_REGS=40, MMA_REGS=232,
                num_warps=kw["num_warps"], maxnreg=kw.get("maxnreg"))
        return linear_kernel, dict(meta, EVEN_K=self.K % kw["BLOCK_K"] == 0, **kw)


# (kernels.gemm_hopper, None), or (None, why this Triton cannot build it)
_hopper_import = functools.partial(runtime.import_gluon, "gemm_hopper", "GEMM", "linear")


def _hopper():
    return _hopper_import()[0]


def other_kernels() -> list:
    """The kernels besides linear_kernel that the tuners' candidates may launch (their source is part
    of the tuning cache's key): gemv_kernel, and the Gluon GEMMs where this Triton builds them."""
    hopper = _hopper()
    return [gemv_kernel] + ([hopper.linear_ws_kernel, hopper.linear_coop_kernel] if hopper else [])


def gluon_problem(x2, res2, out, mode: Mode = Mode.FLOAT) -> str | None:
    """Why the warp-specialized Gluon kernel (kernels/gemm_hopper.py) cannot take this call (float, or
    W8A8: then the output's dtype is the one asked about), or None. (Its x and weight loads are those of
    the tl kernel's TMA configs, checked by the caller.)"""
    if mode not in (Mode.FLOAT, Mode.W8A8, Mode.FP8):
        return "the Gluon GEMM takes float or W8A8 (int8 or fp8 x and weight, half output) calls"
    problem = runtime.gluon_target_problem(out if mode in (Mode.W8A8, Mode.FP8) else x2, "GEMM")
    if problem:
        return problem
    if not tma_ok(out) or (res2 is not None and not tma_ok(res2)):
        return "the output or residual rows are not 16-byte aligned for the copy engine"
    return _hopper_import()[1]


def kernel_args(kw, tensors) -> tuple:
    """linear_kernel's positional arguments for a config's kwargs and the operands: TMA
    descriptors (boxes: the config's tiles) where the config loads by TMA, else the tensors."""
    x2, weight, bias, res, out, a_scale, w_scale = tensors[:7]
    if kw.get("GEMV"):    # (and the norm's weight and eps: launch's norm; out and 0 stand in without one)
        norm_w, eps = tensors[7:] if len(tensors) > 7 else (out, 0.0)
        return (x2, weight, bias, res, out, w_scale, x2.shape[0], weight.shape[0], x2.shape[1], out.shape[1],
                x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                res.stride(0), res.stride(1), out.stride(0), out.stride(1), norm_w, eps)
    if kw.get("COOP"):
        descs = _hopper().coop_descriptors(x2, weight, None if res is out else res, out, kw["BN1"], kw["BN2"],
                                           kw["BLOCK_K"], weight.stride(1) != 1)
        return (*descs, bias, x2.shape[0], weight.shape[0], x2.shape[1])
    if kw.get("GLUON"):
        descs = _hopper().descriptors(x2, weight, None if res is out else res, out, kw["BLOCK_M"], kw["BLOCK_N"],
                                      kw["BLOCK_K"], weight.stride(1) != 1)
        return (*descs, bias, a_scale, w_scale, x2.shape[0], weight.shape[0], x2.shape[1])
    tma = kw["USE_TMA"]
    if not tma:
        w_desc = weight
    elif weight.stride(1) != 1:   # TMA was allowed, so this is weight_by_columns: no check per call
        w_desc = TensorDescriptor.from_tensor(weight.t(), [kw["BLOCK_K"], kw["BLOCK_N"]])
    else:
        w_desc = TensorDescriptor.from_tensor(weight, [kw["BLOCK_N"], kw["BLOCK_K"]])
    return (x2, weight,
            TensorDescriptor.from_tensor(x2, [kw["BLOCK_M"], kw["BLOCK_K"]]) if tma else x2, w_desc,
            bias, res, out, a_scale, w_scale, x2.shape[0], weight.shape[0], x2.shape[1], out.shape[1],
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
            res.stride(0), res.stride(1), out.stride(0), out.stride(1))


def linear_ref(x, weight, bias=None, residual=None, activation="none", residual_first=False,
               allow_tf32=False, norm_weight=None, norm_eps=None):
    """Pure-PyTorch reference: fp32 (fp64 for fp64 inputs) math, result in x.dtype."""
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    acc = torch.matmul(rms_normed_ref(x, norm_weight, norm_eps, acc_dtype), weight.to(acc_dtype).t())
    bias = bias.to(acc_dtype) if bias is not None else None
    residual = residual.to(acc_dtype) if residual is not None else None
    return epilogue_ref(acc, bias, residual, activation, residual_first).to(x.dtype)


@torch.library.custom_op("accelc::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           residual: Optional[torch.Tensor] = None, activation: str = "none",
           residual_first: bool = False, allow_tf32: bool = False, norm_weight: Optional[torch.Tensor] = None,
           norm_eps: Optional[float] = None) -> torch.Tensor:
    """act(x @ weight^T + bias) (+ residual), x's rows first RMS-normalized where norm_eps is given: see the
    module docstring."""
    return runtime.launch_or_fallback("linear", x.device, linear_launch, linear_ref, x, weight, bias, residual,
                                      activation, residual_first, allow_tf32, norm_weight, norm_eps)


@linear.register_fake
def _(x, weight, bias=None, residual=None, activation="none", residual_first=False, allow_tf32=False,
      norm_weight=None, norm_eps=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


__all__ = ["ACTIVATIONS", "linear", "linear_launch", "linear_ref", "norm_problem", "normed_rows", "rms_normed_ref",
           "why_unsupported"]
