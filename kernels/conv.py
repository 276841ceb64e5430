"""accelc::conv2d — Conv2d as an implicit GEMM, NHWC, with the fused epilogue of kernels/epilogue.py.

x (N, C, H, W) in any memory format (read through its strides; a non-channels-last input is
converted once, which in a run of rewritten convs happens only at the run's first conv); weight
pre-packed at optimize time as (K, R, S, C) contiguous (pack_weight); bias (K,); residual (N, K,
OH, OW) any format. A grouped conv (ResNeXt / RegNet: groups of 8-64 channels) is the same op: its
weight packed (K, R, S, C / groups), groups = x's channels over the weight's, each group one slice
of program axis 2 (a GEMM of K / groups columns over its C / groups channels; taps and FLAT_K
gathers only, unsplit). Output (N, K, OH, OW) in channels-last memory, so the next rewritten conv and
PyTorch's elementwise ops and pooling (which keep the format) read NHWC with no conversion.

    out = act(conv(x, w) + bias) + residual      residual_first=False
    out = act(conv(x, w) + bias + residual)      residual_first=True (ResNet: relu(bn(conv) + x))

The GEMM: rows = output pixels (N*OH*OW), columns = output channels K, reduction over (r, s, c),
never materialising the im2col matrix: each program gathers its input patches tap by tap. Four
ways to gather, by the input's channels and strides (RECT or taps chosen by the autotuner):
  RECT    (stride 1, aligned NHWC) the tile is a rectangle of output pixels; each tap's patch is
          one 4-D TMA box of the input, the padding zero-filled by the copy engine;
  taps    (C >= 16) pointer loads tap by tap, BLOCK_K channels at a time, contiguous along C;
  FLAT_K  (C < 16, dilated along W) pointer loads over the flattened (r, s, c) index, so that
          the tensor cores are not fed mostly padding;
  ROWS    (C < 16 otherwise: an RGB stem) the input is first copied with its zero
          padding and channels padded to CP, the weight to (K, R, SP, CP) (rows_geometry), so
          each output pixel's kernel row is one contiguous, 16-byte aligned run of SP pixels x CP
          channels, as is the weight's: vector loads with no per-element index math, one
          tensor-core K step per kernel row.
On sm90 the RECT path also has a warp-specialized Gluon kernel (kernels/conv_hopper.py: the GEMM's persistent
producer / consumer loop over the same boxes), raced with the tl configs; it also takes stride 2 on even maps
(a 5-D phase view of the input), where the tl kernel has no rectangles (gluon_geometry_ok, gluon_problem).
Where the output tiles are few and the reduction long (batch 1-8 at 14x14 / 7x7), the RECT and
taps loops can run in SPLIT slices (SPLIT_CONFIGS): each stores fp32 partial sums, and
_splitk_reduce adds them in slice order and applies the epilogue.
Convs over non-overlapping patches (kernel == stride, no padding or dilation) are plain GEMMs
and go to kernels/gemm.py: 1x1 stride-1 convs on the NHWC view, patch embeddings (ViT's 16x16
stride 16, any kernel size) after one copy that gathers the patches as rows (N*OH*OW, R*S*C).
The candidates the tuner races and their pruning are kernels/conv_configs.py (also read as conv.<name>).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from accelc import runtime
from accelc.kernels import gemm, primitives
# the family's candidates (kernels/conv_configs.py), also read as conv.<name> by its callers
from accelc.kernels.conv_configs import (CONFIGS, GLUON_CONFIGS, GROUPED_CONFIGS, ROWS_CONFIGS,  # noqa: F401
                                         SPLIT_CONFIGS, config, default_config, gluon_config, interpreter_config,
                                         prune_configs, rect_config, rows_config)
from accelc.kernels.epilogue import (ACTIVATION_NAMES, ACTIVATIONS, activation_code, broadcasts_to, epilogue,
                                     epilogue_ref, residual_as)
from accelc.tuning import CompiledCall, Tuner, check_once
from accelc.compile_ahead import launch_kernel

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dot(a, b, acc, INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    if DOT_IN_FP32:   # the interpreter's bf16 tl.dot workaround, see kernels/gemm.py
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _rect_gather(acc, x_desc, w_desc, it_lo, it_hi, C, pad_h, pad_w, dil_h, dil_w, image, oh0, ow0, pid_n,
                 S: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """RECT (stride 1, aligned NHWC): each tap's input patch is the output rectangle shifted by the
    tap, one rectangular box of the NHWC tensor; the copy engine zero-fills what falls outside the
    image (the padding, negative coordinates included), so no masks. Channels past C are zero in x,
    so the weight columns they meet (the next tap's) contribute nothing. One flat loop over (tap,
    channel block), so the pipeline runs on across taps."""
    n_c = tl.cdiv(C, BLOCK_K)
    for it in range(it_lo, it_hi):
        tap = it // n_c
        c0 = (it - tap * n_c) * BLOCK_K
        h_in = oh0 - pad_h + (tap // S) * dil_h
        w_in = ow0 - pad_w + (tap % S) * dil_w
        a = tl.reshape(x_desc.load([image, h_in, w_in, c0]), [BLOCK_M, BLOCK_K])
        b = w_desc.load([pid_n * BLOCK_N, tap * C + c0]).T
        acc = _dot(a, b, acc, INPUT_PRECISION, DOT_IN_FP32)
    return acc


@triton.jit
def _rows_gather(acc, x_img, w_rows, oh, ow, m_ok, n_ok, stride_h, stride_w, dil_h, sx_h,
                 S: tl.constexpr, TAPS: tl.constexpr, ROW_CP: tl.constexpr, ROW_SP: tl.constexpr,
                 ROW_ALIGN: tl.constexpr, ROW_STEP: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 DOT_IN_FP32: tl.constexpr):
    """ROWS (few channels, an RGB stem): x and the weight are the padded copies made by
    _pad_rows_kernel: x (N, Hp, Wp, ROW_CP) with the conv's zero padding around it, the weight (K,
    R, ROW_SP, ROW_CP) (RSC its row length), both contiguous and zero past S and C. Kernel row r of
    output pixel (oh, ow) then reads ROW_SP pixels x ROW_CP channels = ROW_K contiguous elements from
    (oh * stride_h + r * dil_h, ow * stride_w), and the weight's row r is ROW_K contiguous elements:
    16-byte aligned, unmasked vector loads, no per-element index math, one tensor-core K step per
    kernel row. ROW_STEP kernel rows a K step (the last step's rows past R masked)."""
    ROW_K: tl.constexpr = ROW_SP * ROW_CP
    kr = tl.arange(0, ROW_STEP * ROW_K)
    dr = kr // ROW_K                       # the row within the step
    kx = kr % ROW_K                        # the element within the row's run
    x_row = x_img + (oh * stride_h) * sx_h + tl.multiple_of(ow * (stride_w * ROW_CP), ROW_ALIGN)
    R_ROWS = TAPS // S
    for r in range(0, R_ROWS, ROW_STEP):
        row_ok = (r + dr) < R_ROWS
        a = tl.load(x_row[:, None] + ((r + dr) * dil_h * sx_h + kx)[None, :],
                    mask=m_ok[:, None] & row_ok[None, :], other=0.0)
        # the run's pixels past S meet zero weights; zeroed so an inf there gives no NaN
        a = tl.where((kx // ROW_CP < S)[None, :], a, 0.0)
        b = tl.load(w_rows[None, :] + (r * ROW_K + kr)[:, None], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, INPUT_PRECISION, DOT_IN_FP32)
    return acc


@triton.jit
def _flat_k_gather(acc, x_img, w_rows, ih0, iw0, m_ok, n_ok, C, H, W, RSC, dil_h, dil_w, sx_c, sx_h, sx_w,
                   S: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """FLAT_K (C < 16, dilated along W): pointer loads over the flattened (r, s, c) index, so that
    the tensor cores are not fed mostly padding."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, RSC, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < RSC
        c = kk % C
        r = (kk // C) // S
        s = (kk // C) % S
        ih = ih0[:, None] + r[None, :] * dil_h
        iw = iw0[:, None] + s[None, :] * dil_w
        a_ok = m_ok[:, None] & k_ok[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        a = tl.load(x_img[:, None] + c[None, :] * sx_c + ih * sx_h + iw * sx_w, mask=a_ok, other=0.0)
        b = tl.load(w_rows[None, :] + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, INPUT_PRECISION, DOT_IN_FP32)
    return acc


@triton.jit
def _taps_gather(acc, x_img, w_rows, ih0, iw0, m_ok, n_ok, it_lo, it_hi, C, H, W, dil_h, dil_w, sx_c, sx_h, sx_w,
                 S: tl.constexpr, INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """taps (C >= 16): pointer loads tap by tap, BLOCK_K channels at a time, contiguous along C; one
    flat loop over (tap, channel block), as in the RECT path."""
    offs_k = tl.arange(0, BLOCK_K)
    n_c = tl.cdiv(C, BLOCK_K)
    for it in range(it_lo, it_hi):
        tap = it // n_c
        c = (it - tap * n_c) * BLOCK_K + offs_k
        ih = ih0 + (tap // S) * dil_h
        iw = iw0 + (tap % S) * dil_w
        pix_ok = m_ok & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        c_ok = c < C
        a = tl.load((x_img + ih * sx_h + iw * sx_w)[:, None] + c[None, :] * sx_c,
                    mask=pix_ok[:, None] & c_ok[None, :], other=0.0)
        b = tl.load(w_rows[None, :] + (tap * C + c)[:, None], mask=c_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, INPUT_PRECISION, DOT_IN_FP32)
    return acc


@triton.jit(do_not_specialize=["M"])  # sizes that follow the batch or length: one binary for every size
def _conv_kernel(
    # pointers (x_desc: TMA descriptor of x as (N, H, W, C), w_desc: of the packed weight as
    # (K, R*S*C); placeholders unless RECT_OK)
    x_ptr, w_ptr, x_desc, w_desc, bias_ptr, res_ptr, out_ptr,
    # sizes (M = N * OH * OW rows, RSC = R * S * C reduction)
    C, H, W, K, OH, OW, M, RSC,
    # geometry
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    # strides in (n, c, h, w) order; so_split: between the slices' partial sums (SPLIT > 1)
    sx_n, sx_c, sx_h, sx_w, sr_n, sr_c, sr_h, sr_w, so_n, so_c, so_h, so_w, so_split,
    # epilogue
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RESIDUAL_FIRST: tl.constexpr,
    ACTIVATION: tl.constexpr,
    # meta-parameters
    S: tl.constexpr, TAPS: tl.constexpr, FLAT_K: tl.constexpr, RECT: tl.constexpr,
    ROW_CP: tl.constexpr, ROW_SP: tl.constexpr, ROW_ALIGN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr, SPLIT: tl.constexpr, ROW_STEP: tl.constexpr,
):
    """The implicit GEMM: which output pixels and channels this program computes, one of the four
    gathers above for the reduction, then the epilogue (or, SPLIT > 1, the slice's partial sum)."""
    # SPLIT > 1 (few output tiles, a long reduction: batch 1-8 at 14x14 / 7x7): program axis 1
    # takes one of SPLIT contiguous slices of the (tap, channel block) loop and stores its fp32
    # partial sum to out_ptr (the slices' buffer); _splitk_reduce adds them in slice order and
    # applies the epilogue, so results do not depend on timing
    n_iter = TAPS * tl.cdiv(C, BLOCK_K)
    if SPLIT > 1:
        per = tl.cdiv(n_iter, SPLIT)
        it_lo = tl.program_id(1) * per
        it_hi = tl.minimum(it_lo + per, n_iter)
    else:
        it_lo = 0
        it_hi = n_iter
    tl.static_assert(SPLIT == 1 or not (FLAT_K or ROW_CP), "the FLAT_K and ROWS loops are not split")
    if RECT:
        # a BLOCK_H x BLOCK_W rectangle of one image's output pixels (BLOCK_M = BLOCK_H * BLOCK_W)
        tiles_h = tl.cdiv(OH, BLOCK_H)
        tiles_w = tl.cdiv(OW, BLOCK_W)
        pid_m, pid_n = primitives.tile_coords(tl.program_id(0), (M // (OH * OW)) * tiles_h * tiles_w,
                                         tl.cdiv(K, BLOCK_N), GROUP_M)
        i = tl.arange(0, BLOCK_M)
        oh0 = (pid_m % (tiles_h * tiles_w)) // tiles_w * BLOCK_H
        ow0 = (pid_m % tiles_w) * BLOCK_W
        oh = oh0 + i // BLOCK_W
        ow = ow0 + i % BLOCK_W
        img = i * 0 + pid_m // (tiles_h * tiles_w)
        m_ok = (oh < OH) & (ow < OW)
    else:
        pid_m, pid_n = primitives.tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_N), GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        img = offs_m // (OH * OW)
        pix = offs_m % (OH * OW)
        oh = pix // OW
        ow = pix % OW
    # a grouped conv: program axis 2 is the group, C and K its channels in and out (0 otherwise)
    grp = tl.program_id(2)
    x_ptr += grp * C * sx_c
    w_ptr += grp * K * RSC
    bias_ptr += grp * K
    res_ptr += grp * K * sr_c
    out_ptr += grp * K * so_c
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < K
    ih0 = oh * stride_h - pad_h
    iw0 = ow * stride_w - pad_w
    x_img = x_ptr + img * sx_n
    w_rows = w_ptr + offs_n * RSC

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if RECT:
        acc = _rect_gather(acc, x_desc, w_desc, it_lo, it_hi, C, pad_h, pad_w, dil_h, dil_w,
                           pid_m // (tiles_h * tiles_w), oh0, ow0, pid_n, S, INPUT_PRECISION, DOT_IN_FP32,
                           BLOCK_M, BLOCK_N, BLOCK_K)
    elif ROW_CP:
        acc = _rows_gather(acc, x_img, w_rows, oh, ow, m_ok, n_ok, stride_h, stride_w, dil_h, sx_h, S, TAPS,
                           ROW_CP, ROW_SP, ROW_ALIGN, ROW_STEP, INPUT_PRECISION, DOT_IN_FP32)
    elif FLAT_K:
        acc = _flat_k_gather(acc, x_img, w_rows, ih0, iw0, m_ok, n_ok, C, H, W, RSC, dil_h, dil_w, sx_c, sx_h, sx_w,
                             S, INPUT_PRECISION, DOT_IN_FP32, BLOCK_K)
    else:
        acc = _taps_gather(acc, x_img, w_rows, ih0, iw0, m_ok, n_ok, it_lo, it_hi, C, H, W, dil_h, dil_w,
                           sx_c, sx_h, sx_w, S, INPUT_PRECISION, DOT_IN_FP32, BLOCK_K)

    mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + (img * so_n + oh * so_h + ow * so_w)[:, None] + offs_n[None, :] * so_c
    if SPLIT > 1:
        tl.store(out_ptrs + tl.program_id(1) * so_split, acc, mask=mask)
    else:
        res_ptrs = res_ptr + (img * sr_n + oh * sr_h + ow * sr_w)[:, None] + offs_n[None, :] * sr_c
        acc = epilogue(acc, bias_ptr, res_ptrs, mask, offs_n, K, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["P"])  # sizes that follow the batch or length: one binary for every size
def _pad_rows_kernel(x_ptr, out_ptr, B, C, D, Bp, Cp, off_b, off_c, P, s0, s1, s2, s3,
                     DP: tl.constexpr, BLOCK: tl.constexpr):
    """out (A, Bp, Cp, DP) contiguous = x (A, B, C, D) (strides s0..s3) moved by (off_b, off_c)
    along its middle dims, zero elsewhere (the last dim's entries past D included). The ROWS
    path's input (N, H, W, C) -> (N, Hp, Wp, CP), with the conv's padding as the offsets, and its
    weight (K, R, S, C) -> (K, R, SP, CP). P = A * Bp * Cp."""
    pix = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, DP)
    p_ok = pix < P
    a = pix // (Bp * Cp)
    i = (pix // Cp) % Bp - off_b
    j = pix % Cp - off_c
    ok = p_ok & (i >= 0) & (i < B) & (j >= 0) & (j < C)
    v = tl.load(x_ptr + (a * s0 + i * s1 + j * s2)[:, None] + d[None, :] * s3,
                mask=ok[:, None] & (d < D)[None, :], other=0.0)
    tl.store(out_ptr + pix[:, None] * DP + d[None, :], v, mask=p_ok[:, None])


PAD_BLOCK = 256   # pixels a program of _pad_rows_kernel


def rows_geometry(x, weight, stride, dilation, out_hw):
    """The ROWS path's padded input for a conv with few channels (C < 16, an RGB stem) and no
    dilation along W, else None: (CP, SP, Hp, Wp, ALIGN). Each output pixel's kernel row is then a
    run of SP pixels x CP channels, SP * CP >= 16 (one tensor-core K step at least), CP chosen
    so that every run starts 16 bytes aligned (ALIGN elements), Wp a multiple of 16 so the rows
    are too."""
    C = x.shape[1]
    K, R, S, Cw = weight.shape
    if C >= 16 or dilation[1] != 1 or Cw != C:     # (not for grouped convs)
        return None
    align = 16 // x.element_size()
    cp, sp = triton.next_power_of_2(C), triton.next_power_of_2(S)
    while (stride[1] * cp) % align:
        cp *= 2
    while sp * cp < 16:
        sp *= 2
    OH, OW = out_hw
    hp = (OH - 1) * stride[0] + (R - 1) * dilation[0] + 1
    wp = triton.cdiv((OW - 1) * stride[1] + sp, 16) * 16
    return cp, sp, hp, wp, align


@triton.jit(do_not_specialize=["M"])  # sizes that follow the batch or length: one binary for every size
def _splitk_reduce(part_ptr, bias_ptr, res_ptr, out_ptr, M, K, OHW, OW,
                   sr_n, sr_c, sr_h, sr_w, so_n, so_c, so_h, so_w,
                   HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, RESIDUAL_FIRST: tl.constexpr,
                   ACTIVATION: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = epilogue(sum over s of part[s]) for part (SPLIT, M, K) fp32, rows = output pixels."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < K)[None, :]
    ptrs = part_ptr + offs_m[:, None] * K + offs_n[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ptrs + s * M * K, mask=mask, other=0.0)
    img = offs_m // OHW
    oh = (offs_m % OHW) // OW
    ow = offs_m % OW
    res_ptrs = res_ptr + (img * sr_n + oh * sr_h + ow * sr_w)[:, None] + offs_n[None, :] * sr_c
    acc = epilogue(acc, bias_ptr, res_ptrs, mask, offs_n, K, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION)
    tl.store(out_ptr + (img * so_n + oh * so_h + ow * so_w)[:, None] + offs_n[None, :] * so_c,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


# _splitk_reduce's tile (pixels, channels). Split convs have few output pixels (batch 1-8 at 14 x 14 / 7 x 7), so
# rows of 16 spread the slices' sum over 4x the programs of 64-row tiles (ResNet-50's layer4 3x3 at batch 1:
# 32 programs, not 8). On an H100 (Nsight Compute) the reduce
# took 7.6-10.4 us with 64 rows, longer than the conv itself (7.4-8.5 us), and 3.6-4.3 us with 16; batch-1
# layer3 / layer4 3x3 went from 0.71x / 0.94x cuDNN to 0.94x / 1.29x (bench/conv.py). The tuner times a split
# config with its reduce, so the tile keys the tuning cache (TUNER's launch_identity).
REDUCE_BLOCK = (16, 64)


# (kernels.conv_hopper, None), or (None, why this Triton cannot build it)
_hopper_import = functools.partial(runtime.import_gluon, "conv_hopper", "conv", "conv2d")


def _hopper():
    return _hopper_import()[0]


def _other_kernels() -> list:
    """The split reduction and the Gluon conv where this Triton builds it (their source is part of the
    tuning cache's key)."""
    hopper = _hopper()
    return [_splitk_reduce] + ([hopper.conv_ws_kernel] if hopper else [])


def _tma_nhwc_ok(t: torch.Tensor) -> bool:
    """An NHWC view (its tma_view) whose 4-D boxes the copy engine takes: channels contiguous, every other
    stride a non-zero 16-byte multiple (a broadcast residual is not), the base aligned."""
    size = t.element_size()
    return (t.stride(3) == 1 and all(st > 0 and st * size % 16 == 0 for st in t.stride()[:3])
            and t.data_ptr() % 16 == 0 and t.shape[3] * size >= 16)


def gluon_problem(x_nhwc, res_nhwc, out_nhwc) -> str | None:
    """Why the warp-specialized Gluon conv (kernels/conv_hopper.py) cannot take this call, whose geometry
    gluon_geometry_ok accepted, or None."""
    problem = runtime.gluon_target_problem(x_nhwc, "conv")
    if problem:
        return problem
    if not all(_tma_nhwc_ok(t) for t in (out_nhwc, res_nhwc) if t is not None):
        return "the output or residual is not a 16-byte aligned NHWC tensor for the copy engine"
    return _hopper_import()[1]


TUNER = Tuner("conv2d", _conv_kernel, CONFIGS, prune=prune_configs, default=default_config,
              interpreter=interpreter_config, other_kernels=_other_kernels,
              launch_identity=f"split reduce tile {REDUCE_BLOCK}")


def groups_of(x: torch.Tensor, weight: torch.Tensor) -> int:
    """A conv's groups, from x's channels and the packed weight's channels a group (K, R, S, C / groups)."""
    return x.shape[1] // weight.shape[3]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(K, C, R, S) as nn.Conv2d stores it -> (K, R, S, C) contiguous: done once at optimize time."""
    return weight.permute(0, 2, 3, 1).contiguous()


def output_size(h, w, r, s, stride, padding, dilation):
    """padding: (top, bottom, left, right)."""
    oh = (h + padding[0] + padding[1] - dilation[0] * (r - 1) - 1) // stride[0] + 1
    ow = (w + padding[2] + padding[3] - dilation[1] * (s - 1) - 1) // stride[1] + 1
    return oh, ow


def nhwc_view(x: torch.Tensor) -> torch.Tensor:
    """x (N, C, H, W) in channels-last memory as an (N, H, W, C) view whose size-1 dims have
    strides a TMA descriptor takes (primitives.tma_view)."""
    return primitives.tma_view(x.permute(0, 2, 3, 1))


def _boxes_ok(x_nhwc: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether TMA boxes can gather this conv's input and weight: at least 16 channels, NHWC rows and every
    stride 16-byte aligned."""
    return x_nhwc.shape[3] >= 16 and _tma_nhwc_ok(x_nhwc) and weight.data_ptr() % 16 == 0


def rect_ok(x_nhwc: torch.Tensor, weight: torch.Tensor, stride) -> bool:
    """Whether the tl kernel's TMA-rectangle path can take this conv: stride 1, and _boxes_ok."""
    return tuple(stride) == (1, 1) and _boxes_ok(x_nhwc, weight)


def gluon_geometry_ok(x_nhwc: torch.Tensor, weight: torch.Tensor, stride) -> bool:
    """Whether the Gluon conv's boxes can gather this conv's input: _boxes_ok at stride 1; at stride 2 also
    even H and W with W's stride C, as its 5-D phase view needs (conv_hopper.phase_view)."""
    _, H, W, C = x_nhwc.shape
    phase_ok = tuple(stride) == (2, 2) and H % 2 == 0 and W % 2 == 0 and x_nhwc.stride(2) == C
    return (tuple(stride) == (1, 1) or phase_ok) and _boxes_ok(x_nhwc, weight)


MAX_KERNEL = 7


def is_patchify(weight_shape, stride, padding, dilation) -> bool:
    """Non-overlapping patches (kernel == stride, no padding, no dilation): a plain GEMM."""
    return tuple(weight_shape[1:3]) == tuple(stride) and not any(padding) and tuple(dilation) == (1, 1)


def why_unsupported(x, weight, bias=None, residual=None, stride=(1, 1), padding=(0, 0, 0, 0), dilation=(1, 1),
                    activation="none") -> str | None:
    """Why accelc::conv2d cannot take these operands (weight packed (K, R, S, C); padding (top,
    bottom, left, right)), or None. Works on meta tensors: the conv rule asks it before packing."""
    if x.dim() != 4 or weight.dim() != 4:
        return f"x must be (N, C, H, W) and weight packed (K, R, S, C), got {tuple(x.shape)}, {tuple(weight.shape)}"
    N, C, H, W = x.shape
    K, R, S, Cw = weight.shape
    if Cw < 1 or C % Cw or K % (C // Cw):
        return (f"x has {C} channels but the packed weight {tuple(weight.shape)} takes {Cw} a group: not a "
                "whole number of groups of in and out channels")
    if (R > MAX_KERNEL or S > MAX_KERNEL) and not is_patchify(weight.shape, stride, padding, dilation):
        return (f"kernel {R}x{S} over {MAX_KERNEL}x{MAX_KERNEL} (taken only as a patch embedding: stride = kernel, "
                "no padding)")
    return operands_problem(x, weight, bias, residual, K, output_size(H, W, R, S, stride, padding, dilation),
                            activation)


def operands_problem(x, weight, bias, residual, K, out_hw, activation) -> str | None:
    """What is wrong with a conv's dtypes, devices, bias (K,), residual (shaped as the output
    (N, K, OH, OW)), output size or activation, or None (conv2d and conv2d_depthwise)."""
    N, _, H, W = x.shape
    OH, OW = out_hw
    if x.dtype not in SUPPORTED_DTYPES:
        return f"dtype {x.dtype} is not supported (fp16, bf16, fp32)"
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            return f"{name} is {t.dtype} on {t.device}, x is {x.dtype} on {x.device}"
    if bias is not None and tuple(bias.shape) != (K,):
        return f"bias must be ({K},), got {tuple(bias.shape)}"
    if residual is not None and not broadcasts_to(residual, (N, K, OH, OW)):
        return f"residual {tuple(residual.shape)} does not broadcast to the output's shape {(N, K, OH, OW)}"
    if (OH <= 0 or OW <= 0) and N * K > 0:
        return f"output size {OH}x{OW} for input {H}x{W}"
    if activation not in ACTIVATIONS:
        return f"activation must be one of {ACTIVATION_NAMES}, not {activation!r}"
    return None


_CHECKED: set = set()   # call signatures whose operands why_unsupported accepted


def conv2d_launch(x, weight, bias, residual, stride, padding, dilation, activation="none",
                  residual_first=False, allow_tf32=False):
    """Checks, allocates, launches. weight: packed (K, R, S, C); stride, dilation: (h, w);
    padding: (top, bottom, left, right). A call signature seen before launches its compiled
    kernel directly (accelc.tuning.CompiledCall)."""
    sig = (x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype,
           None if bias is None else (bias.shape, bias.dtype, bias.device),
           None if residual is None else (residual.shape, residual.stride(), residual.dtype, residual.device),
           tuple(stride), tuple(padding), tuple(dilation), activation, bool(residual_first), bool(allow_tf32))
    check_once(_CHECKED, sig, lambda: why_unsupported(x, weight, bias, residual, stride, padding, dilation,
                                                       activation), "conv2d")
    N, C, H, W = x.shape
    K, R, S, _ = weight.shape
    OH, OW = output_size(H, W, R, S, stride, padding, dilation)
    out = torch.empty((N, K, OH, OW), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    if out.numel() == 0:
        return out
    residual = residual_as(residual, out.shape, memory_format=torch.channels_last)
    if groups_of(x, weight) == 1 and is_patchify(weight.shape, stride, padding, dilation):
        _patchify_gemm(x, weight, bias, residual, out, activation, residual_first, allow_tf32)
        return out
    x = x.contiguous(memory_format=torch.channels_last)  # a no-op inside a run of rewritten convs
    tensors = (x, weight, bias if bias is not None else out, residual if residual is not None else out, out)
    key_here = (sig, tuple(t.data_ptr() % 16 for t in tensors))
    with runtime.device_guard(x):
        known = TUNER.calls.get(key_here)
        if known is not None:
            calls, kw = known
            calls(kw, tensors, stride, padding, dilation, x.device.index or 0)
            return out
        plan = ConvPlan.of(x, weight, bias, residual, out, stride, dilation, activation, residual_first, allow_tf32)
        run_tensors = _Pad(plan.rows, x, weight, padding).tensors(tensors) if plan.rows else tensors

        def run(cfg):   # through Triton: tuning times this
            kw = cfg.all_kwargs()
            plan.refuse(kw)
            part = _Calls.partials(kw, out)
            kernel, grid, args, constexprs = _launch(kw, run_tensors, stride, padding, dilation, plan.meta,
                                                     plan.groups, part)
            launch_kernel(kernel, grid, args, constexprs)
            if part is not None:
                launch_kernel(_splitk_reduce, _Calls.reduce_grid(out), _reduce_args(part, tensors),
                              _reduce_meta(kw, plan.meta))

        kw = TUNER.pick(plan.tuning_key(), plan.problem(), run).all_kwargs()
        TUNER.calls[key_here] = (_Calls(kw, tensors, stride, padding, dilation, plan.meta, plan.rows), kw)
    return out


def _patchify_gemm(x, weight, bias, residual, out, activation, residual_first, allow_tf32) -> None:
    """A conv over non-overlapping patches as the GEMM it is, (N*OH*OW, R*S*C) @ (K, R*S*C)^T: rows = patches in
    (r, s, c) order, as the packed weight. A 1x1 stride-1 conv on channels-last input gathers nothing (the NHWC
    view); a patch embedding's one copy gathers its patches."""
    N, C, _, _ = x.shape
    K, R, S, _ = weight.shape
    OH, OW = out.shape[2:]
    patches = x[:, :, :OH * R, :OW * S].reshape(N, C, OH, R, OW, S).permute(0, 2, 4, 3, 5, 1)
    res2 = residual.permute(0, 2, 3, 1).reshape(-1, K) if residual is not None else None
    gemm.launch(patches.reshape(N * OH * OW, R * S * C), weight.view(K, R * S * C), bias, res2,
                out.permute(0, 2, 3, 1).view(-1, K), activation, residual_first, allow_tf32)


@dataclasses.dataclass
class ConvPlan:
    """What a conv call's operands decide for every config of it (the implicit-GEMM paths; patch convs are GEMMs):
    the problem's sizes, its gather (ROWS geometry, whether TMA rectangles and the Gluon conv can take it), the
    epilogue's and gathers' constexprs (meta); the tuning key and the configs' prune problem."""
    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    Cg: int
    OH: int
    OW: int
    stride: tuple
    groups: int
    rows: tuple | None
    rect: bool
    gluon: bool
    dtype: torch.dtype
    meta: dict

    @classmethod
    def of(cls, x, weight, bias, residual, out, stride, dilation, activation, residual_first, allow_tf32) -> ConvPlan:
        """x channels-last; residual None or shaped as `out`."""
        N, C, H, W = x.shape
        K, R, S, Cg = weight.shape
        OH, OW = out.shape[2:]
        groups = groups_of(x, weight)
        rows = rows_geometry(x, weight, stride, dilation, (OH, OW))
        x_nhwc, ungrouped = nhwc_view(x), rows is None and groups == 1
        rect = ungrouped and rect_ok(x_nhwc, weight, stride)
        gluon = (ungrouped and gluon_geometry_ok(x_nhwc, weight, stride)
                 and gluon_problem(x_nhwc, nhwc_view(residual) if residual is not None else None,
                                   nhwc_view(out)) is None)
        cp, sp, _, _, align = rows or (0, 0, 0, 0, 0)
        meta = dict(HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                    RESIDUAL_FIRST=bool(residual_first), ACTIVATION=activation_code(activation), S=S, TAPS=R * S,
                    FLAT_K=Cg < 16 and rows is None, ROW_CP=cp, ROW_SP=sp, ROW_ALIGN=align,
                    INPUT_PRECISION="tf32" if (allow_tf32 and x.dtype == torch.float32) else "ieee",
                    DOT_IN_FP32=runtime.interpreted() and x.dtype == torch.bfloat16)
        return cls(N, C, H, W, K, R, S, Cg, OH, OW, tuple(stride), groups, rows, rect, gluon, x.dtype, meta)

    @property
    def M(self) -> int:
        return self.N * self.OH * self.OW

    def tuning_key(self) -> tuple:
        """Every batch size of a bucket (next power of two of the pixel count) shares one tuning run."""
        return (triton.next_power_of_2(self.M), self.K, self.C, self.R * self.S, self.Cg < 16, self.rows is not None,
                self.stride[0], self.rect, self.dtype, *((self.groups,) if self.groups > 1 else ()),
                *(("gluon",) if self.gluon else ()))

    def problem(self) -> dict:
        """What the configs' prune reads (kernels/conv_configs.py)."""
        return dict(N=self.N, C=self.Cg, H=self.H, W=self.W, K=self.K // self.groups, R=self.R, S=self.S,
                    OH=self.OH, OW=self.OW, M=self.M, stride=self.stride[0], rect=self.rect,
                    rows=self.rows is not None, groups=self.groups, gluon=self.gluon)

    def refuse(self, kw) -> None:
        """A config this call cannot run, refused with its reason (the tuner skips it)."""
        if kw.get("GLUON") and not self.gluon:
            raise ValueError("accelc::conv2d: a Gluon config for a call the Gluon conv cannot take")


class _Pad:
    """The ROWS path's padded copies (rows_geometry) of x and the weight, allocated per call and
    filled by two launches of _pad_rows_kernel (CompiledCalls after the first). `x` is the
    padded input as an (N, CP, Hp, Wp) view, `weight` the padded (K, R, SP, CP) weight."""

    def __init__(self, rows, x, weight, padding, calls=None):
        cp, sp, hp, wp, _ = rows
        N, C, H, W = x.shape
        K, R, S, _ = weight.shape
        xbuf = torch.empty((N, hp, wp, cp), dtype=x.dtype, device=x.device)
        self.x, self.weight = xbuf.permute(0, 3, 1, 2), torch.empty((K, R, sp, cp), dtype=x.dtype, device=x.device)
        sx = x.stride()
        jobs = [((x, xbuf, H, W, C, hp, wp, padding[0], padding[2], N * hp * wp, sx[0], sx[2], sx[3], sx[1]),
                 triton.cdiv(N * hp * wp, PAD_BLOCK)),
                ((weight, self.weight, R, S, C, R, sp, 0, 0, K * R * sp, *weight.stride()),
                 triton.cdiv(K * R * sp, PAD_BLOCK))]
        if calls is None:
            self.calls = [CompiledCall(_pad_rows_kernel, (g,), args, dict(DP=cp, BLOCK=PAD_BLOCK)) for args, g in jobs]
        else:
            self.calls = calls
            for call, (args, _) in zip(calls, jobs):
                call(args, x.device.index or 0)

    def tensors(self, tensors):
        """The conv's (x, weight, bias, res, out) with x and the weight replaced by the copies."""
        return (self.x, self.weight) + tuple(tensors[2:])


class _Calls:
    """The launches of one call signature: the conv kernel's CompiledCall, and where the config
    splits the reduction (SPLIT > 1) the partial sums' buffer, allocated per call, and the
    reduce kernel's. Constructing it launches both once; calling it launches them again on new
    tensors of the same signature."""

    def __init__(self, kw, tensors, stride, padding, dilation, meta, rows=None):
        x, weight, bias, res, out = tensors
        self.rows, self.pad = rows, None
        if rows:
            first = _Pad(rows, x, weight, padding)
            self.pad = first.calls
            tensors = first.tensors(tensors)
        part = self.partials(kw, out)
        self.main = CompiledCall(*_launch(kw, tensors, stride, padding, dilation, meta, groups_of(x, weight), part))
        self.reduce = None
        if part is not None:
            self.reduce = CompiledCall(_splitk_reduce, self.reduce_grid(out), _reduce_args(part, tensors),
                                       _reduce_meta(kw, meta))

    @property
    def direct(self):
        return self.main.direct

    @staticmethod
    def grid(kw, out, groups=1):
        N, K, OH, OW = out.shape
        rows = (N * triton.cdiv(OH, kw["BLOCK_H"]) * triton.cdiv(OW, kw["BLOCK_W"]) if kw["RECT"]
                else triton.cdiv(N * OH * OW, kw["BLOCK_M"]))
        return (rows * triton.cdiv(K // groups, kw["BLOCK_N"]), kw["SPLIT"], groups)

    @staticmethod
    def reduce_grid(out):
        N, K, OH, OW = out.shape
        return (triton.cdiv(N * OH * OW, REDUCE_BLOCK[0]), triton.cdiv(K, REDUCE_BLOCK[1]))

    @staticmethod
    def partials(kw, out):
        if kw["SPLIT"] == 1:
            return None
        N, K, OH, OW = out.shape
        return torch.empty((kw["SPLIT"], N * OH * OW, K), dtype=torch.float32, device=out.device)

    def __call__(self, kw, tensors, stride, padding, dilation, device_index):
        if self.rows:   # the padded copies (ROWS), made by the remembered pad launches
            tensors = _Pad(self.rows, tensors[0], tensors[1], padding, self.pad).tensors(tensors)
        part = self.partials(kw, tensors[4])
        self.main(_launch_args(kw, tensors, stride, padding, dilation, part), device_index)
        if part is not None:
            self.reduce(_reduce_args(part, tensors), device_index)


def _launch(kw, tensors, stride, padding, dilation, meta, groups, part):
    """(kernel, grid, positional arguments, constexprs and launch options) of a config: the Gluon conv's
    (persistent: at most one CTA an SM) or _conv_kernel's."""
    args = _launch_args(kw, tensors, stride, padding, dilation, part)
    if not kw.get("GLUON"):
        return _conv_kernel, _Calls.grid(kw, tensors[4], groups), args, dict(meta, **kw)
    N, K, OH, OW = tensors[4].shape
    bh, bw = kw["BLOCK_H"], kw["BLOCK_W"]
    tiles = N * triton.cdiv(OH, bh) * triton.cdiv(OW, bw) * triton.cdiv(K, kw["BLOCK_N"])
    constexprs = dict(HAS_BIAS=meta["HAS_BIAS"], HAS_RESIDUAL=meta["HAS_RESIDUAL"],
                      RESIDUAL_FIRST=meta["RESIDUAL_FIRST"], ACTIVATION=meta["ACTIVATION"], STAGES=kw["STAGES"],
                      GROUP_M=kw["GROUP_M"], CONSUMERS=kw["CONSUMERS"], LOAD_REGS=40, MMA_REGS=232,
                      STRIDE=stride[0], num_warps=kw["num_warps"], maxnreg=kw.get("maxnreg"))
    return _hopper().conv_ws_kernel, (min(tiles, primitives.sm_count(tensors[0].device.index or 0)),), args, constexprs


def _launch_args(kw, tensors, stride, padding, dilation, part) -> tuple:
    """A config's positional arguments: the Gluon conv's (its four descriptors, the bias, sizes and geometry;
    it is never split) or _conv_kernel's (_args)."""
    if not kw.get("GLUON"):
        return _args(kw, tensors, stride, padding, dilation, part)
    x, weight, bias, res, out = tensors
    N, C, _, _ = x.shape
    K, R, S, _ = weight.shape
    descs = _hopper().descriptors(nhwc_view(x), weight.view(K, R * S * C), None if res is out else nhwc_view(res),
                                  nhwc_view(out), kw["BLOCK_H"], kw["BLOCK_W"], kw["BLOCK_N"], kw["BLOCK_K"], stride[0])
    return (*descs, bias, N, *out.shape[2:], K, C, R, S, padding[0], padding[2], dilation[0], dilation[1])


def _args(kw, tensors, stride, padding, dilation, part=None) -> tuple:
    """_conv_kernel's positional arguments for a config's kwargs: TMA descriptors (boxes: the
    config's tile) where the config gathers by TMA rectangles, else the tensors. With part (the
    (SPLIT, M, K) fp32 partial sums of a split config) the kernel stores there instead of out."""
    x, weight, bias, res, out = tensors
    N, _, H, W = x.shape
    K, R, S, C = weight.shape     # (ROWS: the padded copies, C = CP, R * S * C the padded row length)
    K //= groups_of(x, weight)    # a grouped conv: the sizes of one group
    OH, OW = out.shape[2:]
    rect = kw["RECT"]
    if part is None:
        dest, dest_strides = out, (*out.stride(), 0)
    else:   # (N, K, OH, OW) strides of the (M, K) slices, rows in (n, oh, ow) order
        dest, dest_strides = part, (OH * OW * K, 1, OW * K, K, N * OH * OW * K)
    return (x, weight,
            TensorDescriptor.from_tensor(nhwc_view(x), [1, kw["BLOCK_H"], kw["BLOCK_W"], kw["BLOCK_K"]]) if rect else x,
            TensorDescriptor.from_tensor(weight.view(K, R * S * C), [kw["BLOCK_N"], kw["BLOCK_K"]]) if rect else weight,
            bias, res, dest, C, H, W, K, OH, OW, N * OH * OW, R * S * C,
            stride[0], stride[1], padding[0], padding[2], dilation[0], dilation[1],
            *x.stride(), *res.stride(), *dest_strides)


def _reduce_meta(kw, meta) -> dict:
    return dict(HAS_BIAS=meta["HAS_BIAS"], HAS_RESIDUAL=meta["HAS_RESIDUAL"], RESIDUAL_FIRST=meta["RESIDUAL_FIRST"],
                ACTIVATION=meta["ACTIVATION"], SPLIT=kw["SPLIT"], BLOCK_M=REDUCE_BLOCK[0], BLOCK_N=REDUCE_BLOCK[1])


def _reduce_args(part, tensors) -> tuple:
    x, weight, bias, res, out = tensors
    N, K, OH, OW = out.shape
    return (part, bias, res, out, N * OH * OW, K, OH * OW, OW, *res.stride(), *out.stride())


def conv2d_ref(x, weight, bias, residual, stride, padding, dilation, activation="none",
               residual_first=False, allow_tf32=False):
    """Pure-PyTorch reference on the packed weight: fp32 (fp64 for fp64) math, channels-last
    result in x's dtype; an unbatched image (C, H, W), as F.conv2d takes one (what a call runs where the kernel
    takes none: OptimizedModule.call_flat), gives its unbatched result."""
    if x.dim() == 3:
        return conv2d_ref(x[None], weight, bias, None if residual is None else residual[None], stride, padding,
                          dilation, activation, residual_first, allow_tf32)[0].contiguous()
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xp = torch.nn.functional.pad(x.to(acc), (padding[2], padding[3], padding[0], padding[1]))
    y = torch.nn.functional.conv2d(xp, weight.to(acc).permute(0, 3, 1, 2), None, tuple(stride), 0, tuple(dilation),
                                   groups_of(x, weight))
    y = epilogue_ref(y.permute(0, 2, 3, 1), None if bias is None else bias.to(acc),
                     None if residual is None else residual.to(acc).permute(0, 2, 3, 1), activation, residual_first)
    return y.permute(0, 3, 1, 2).to(x.dtype).contiguous(memory_format=torch.channels_last)


@torch.library.custom_op("accelc::conv2d", mutates_args=())
def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
           stride: List[int], padding: List[int], dilation: List[int], activation: str = "none",
           residual_first: bool = False, allow_tf32: bool = False) -> torch.Tensor:
    """act(conv(x, weight) + bias) (+ residual): see the module docstring."""
    return runtime.launch_or_fallback("conv2d", x.device, conv2d_launch, conv2d_ref, x, weight, bias, residual,
                                      stride, padding, dilation, activation, residual_first, allow_tf32)


@conv2d.register_fake
def _(x, weight, bias, residual, stride, padding, dilation, activation="none", residual_first=False,
      allow_tf32=False):
    N, _, H, W = x.shape
    K, R, S, _ = weight.shape
    OH, OW = output_size(H, W, R, S, stride, padding, dilation)
    return x.new_empty((N, K, OH, OW)).contiguous(memory_format=torch.channels_last)
