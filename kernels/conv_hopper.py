"""accelc::conv2d on Hopper (sm90): the implicit GEMM of kernels/conv.py's RECT path on the warp-specialized
main loop of kernels/gemm_hopper.py (persistent CTAs, a TMA load partition, one or two MMA warpgroups).

A tile is a BLOCK_H x BLOCK_W rectangle of one image's output pixels by BLOCK_N output channels. For each
tap (r, s) and block of BLOCK_K input channels the load partition brings the input rectangle shifted by
the tap as one 4-D TMA box of the NHWC input, (1, BLOCK_H, BLOCK_W, BLOCK_K) at (image, oh0 - pad_h + r *
dil_h, ow0 - pad_w + s * dil_w, c0): the copy engine zero-fills what lies outside the image (the padding,
negative coordinates included), so there are no masks. The weight, packed (K, R, S, C), is read as the
(K, R*S*C) matrix, a (BLOCK_N, BLOCK_K) box at (n0, tap * C + c0). In shared memory the 4-D box is the
(BLOCK_H * BLOCK_W, BLOCK_K) operand wgmma reads (same rows, same swizzle): the consumers reshape the
descriptor, where the tl kernel (Triton's tl cannot) goes through registers (conv.rect_config). The
output and the residual are 4-D boxes of the NHWC output too, clipped at the image's edge by the copy
engine. C a multiple of BLOCK_K (a channel block never reaches into the next tap's weights).

Stride 2 (even H and W) reads the same (pixels, channels) box from a 5-D view of the input, (N, H / 2, 2,
W / 2, 2 * C): input pixel (2 * h2 + hp, 2 * w2 + wp) is element (h2, hp, w2, wp * C + c). A tap's offset
o = r * dil - pad along H splits into o = 2 * q + p (p = o mod 2), so output pixels oh0.. read h2 = oh0 + q..
at the fixed phase hp = p: a (1, BLOCK_H, 1, BLOCK_W, BLOCK_K) box, contiguous along w2 as at stride 1, and
the copy engine zero-fills the padding as before (q = -1 at the top and left edges). conv.py sends every
other conv to its tl kernel, which is also this one's reference.

The ring's protocol is the GEMM's (gemm_hopper: `ready` / `empty` per slot, two consumers taking turns
on the ring, a 4-warp load partition beside two consumers), so are the epilogue (epilogue.finish) and
the register split.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from accelc.kernels.primitives import tile_coords
from accelc.kernels.gemm_hopper import (GL_DTYPES, allocate_ring, finish_tile, ring_release, ring_slot, tma_load,
                                        tma_store)
from accelc.kernels.hopper_args import ConvArgs
from accelc.kernels.gemm_hopper import smem_bytes as gemm_smem_bytes


@gluon.jit
def _tile_origin(tile, N_IMG, OH, OW, K, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_N: gl.constexpr,
                 GROUP_M: gl.constexpr):
    """(image, oh0, ow0, n0) of a tile: its rectangle's first output pixel and its first channel."""
    tiles_h = gl.cdiv(OH, BLOCK_H)
    tiles_w = gl.cdiv(OW, BLOCK_W)
    pid_m, pid_n = tile_coords(tile, N_IMG * tiles_h * tiles_w, gl.cdiv(K, BLOCK_N), GROUP_M)
    rect = pid_m % (tiles_h * tiles_w)
    return pid_m // (tiles_h * tiles_w), rect // tiles_w * BLOCK_H, rect % tiles_w * BLOCK_W, pid_n * BLOCK_N


@gluon.jit
def _num_tiles(N_IMG, OH, OW, K, BLOCK_H: gl.constexpr, BLOCK_W: gl.constexpr, BLOCK_N: gl.constexpr):
    return N_IMG * gl.cdiv(OH, BLOCK_H) * gl.cdiv(OW, BLOCK_W) * gl.cdiv(K, BLOCK_N)


@gluon.jit
def _conv_load(p):
    """The producer: for every tile of this CTA, every (tap, channel block)'s input box and weight box
    (STRIDE 2: from the 5-D view, at the tap's phase)."""
    BLOCK_K: gl.constexpr = p.BLOCK_K
    C = p.C
    S = p.S
    n_c = C // BLOCK_K
    step = 0
    for tile in range(gl.program_id(0), _num_tiles(p.N_IMG, p.OH, p.OW, p.K, p.BLOCK_H, p.BLOCK_W, p.BLOCK_N),
                      gl.num_programs(0)):
        image, oh0, ow0, n0 = _tile_origin(tile, p.N_IMG, p.OH, p.OW, p.K, p.BLOCK_H, p.BLOCK_W, p.BLOCK_N,
                                           p.GROUP_M)
        for it in range(p.R * S * n_c):
            tap = it // n_c
            c0 = (it - tap * n_c) * BLOCK_K
            slot, phase = ring_slot(step, p.STAGES)
            mbarrier.wait(p.empty.index(slot), phase ^ 1)   # the first wait of a slot passes
            bar = p.ready.index(slot)
            mbarrier.expect(bar, p.x_desc.block_type.nbytes + p.w_desc.block_type.nbytes)
            off_h = (tap // S) * p.dil_h - p.pad_h
            off_w = (tap % S) * p.dil_w - p.pad_w
            if p.STRIDE == 1:
                tma_load(p.x_desc, [image, oh0 + off_h, ow0 + off_w, c0], bar, p.x_bufs.index(slot))
            else:   # off = 2 * q + p, p = off & 1 (also for negative off): box at (h2, hp, w2, wp * C + c)
                tma_load(p.x_desc, [image, oh0 + (off_h >> 1), off_h & 1, ow0 + (off_w >> 1), (off_w & 1) * C + c0],
                         bar, p.x_bufs.index(slot))
            tma_load(p.w_desc, [n0, tap * C + c0], bar, p.w_bufs.index(slot))
            step += 1


@gluon.jit
def _conv_mma(p, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, WARPS: gl.constexpr):
    """A consumer: wgmma over the ring for its tiles (the input box read as the (pixels, channels) operand),
    then the epilogue and the output box's TMA store. The ring's order is gemm_hopper._mma_partition's."""
    BLOCK_M: gl.constexpr = p.BLOCK_H * p.BLOCK_W
    BLOCK_N: gl.constexpr = p.BLOCK_N
    BLOCK_K: gl.constexpr = p.BLOCK_K
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    k_tiles = p.R * p.S * (p.C // BLOCK_K)
    c_box = p.c_bufs.index(CONSUMER)                  # (1, BLOCK_H, BLOCK_W, BLOCK_N): the output's box
    c_buf = c_box.reshape([BLOCK_M, BLOCK_N])         # the same bytes as the accumulator's rows
    res_bar = p.res_ready.index(CONSUMER)
    step = CONSUMER * k_tiles
    done = 0
    for tile in range(gl.program_id(0) + CONSUMER * gl.num_programs(0),
                      _num_tiles(p.N_IMG, p.OH, p.OW, p.K, p.BLOCK_H, p.BLOCK_W, BLOCK_N), CONSUMERS * gl.num_programs(0)):
        image, oh0, ow0, n0 = _tile_origin(tile, p.N_IMG, p.OH, p.OW, p.K, p.BLOCK_H, p.BLOCK_W, BLOCK_N, p.GROUP_M)
        if p.HAS_RESIDUAL:
            tma.store_wait(0)
            mbarrier.expect(res_bar, p.res_desc.block_type.nbytes)
            tma_load(p.res_desc, [image, oh0, ow0, n0], res_bar, c_box)
        if CONSUMERS == 2:
            # turns on the ring, as in gemm_hopper (a barrier's phase says only odd or even)
            mbarrier.wait(p.turn.index(CONSUMER), (done + CONSUMER + 1) & 1, pred=done + CONSUMER > 0)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for kk in range(k_tiles):
            slot, phase = ring_slot(step, p.STAGES)
            mbarrier.wait(p.ready.index(slot), phase)
            a = p.x_bufs.index(slot).reshape([BLOCK_M, BLOCK_K])
            acc = warpgroup_mma(a, p.w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            ring_release(p.empty, step, p.STAGES, kk > 0)
            step += 1
        if CONSUMERS == 2:
            mbarrier.arrive(p.turn.index(1 - CONSUMER))
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        ring_release(p.empty, step, p.STAGES, k_tiles > 0)
        step += (CONSUMERS - 1) * k_tiles

        finish_tile(acc, p.bias_ptr, n0, p.K, c_buf, res_bar, done, acc_layout, p.HAS_BIAS, p.HAS_RESIDUAL,
                    p.RESIDUAL_FIRST, p.ACTIVATION, False)
        tma_store(p.out_desc, [image, oh0, ow0, n0], c_box)    # clipped at the image's edge
        done += 1
    tma.store_wait(0)


@gluon.jit
def _conv_consumer_1(p):
    _conv_mma(p, 1, 2, 4)


@gluon.jit(do_not_specialize=["N_IMG"])  # sizes that follow the batch or length: one binary for every size
def conv_ws_kernel(
    # TMA descriptors: the NHWC input's (1, BLOCK_H, BLOCK_W, BLOCK_K) boxes, the packed weight's (BLOCK_N,
    # BLOCK_K) boxes of (K, R*S*C), the NHWC output's and residual's (1, BLOCK_H, BLOCK_W, BLOCK_N) boxes
    # (res_desc: the output's without a residual); the bias pointer
    x_desc, w_desc, out_desc, res_desc, bias_ptr,
    # sizes and geometry
    N_IMG, OH, OW, K, C, R, S, pad_h, pad_w, dil_h, dil_w,
    # epilogue
    HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, RESIDUAL_FIRST: gl.constexpr, ACTIVATION: gl.constexpr,
    # meta-parameters (tiles come with the descriptors' boxes)
    STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr, LOAD_REGS: gl.constexpr,
    MMA_REGS: gl.constexpr, STRIDE: gl.constexpr, num_warps: gl.constexpr,
):
    BLOCK_H: gl.constexpr = out_desc.block_type.shape[1]      # (x_desc's box: 5-D at stride 2)
    BLOCK_W: gl.constexpr = out_desc.block_type.shape[2]
    BLOCK_K: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    bufs, bars = allocate_ring(x_desc, w_desc, out_desc, STAGES, CONSUMERS)   # (one level a line: triton 3.6's
    x_bufs, w_bufs, c_bufs = bufs                                             # cache key fails on nested targets)
    ready, empty, res_ready, turn = bars
    p = ConvArgs(x_desc, w_desc, out_desc, res_desc, x_bufs, w_bufs, c_bufs, ready, empty, res_ready, turn, bias_ptr,
                 N_IMG, OH, OW, K, C, R, S, pad_h, pad_w, dil_h, dil_w, BLOCK_H, BLOCK_W, BLOCK_N, BLOCK_K, STAGES,
                 GROUP_M, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, STRIDE)
    if CONSUMERS == 1:
        gl.warp_specialize([(_conv_mma, (p, 0, 1, num_warps)), (_conv_load, (p, ))], [1], [LOAD_REGS])
    else:
        gl.warp_specialize([(_conv_mma, (p, 0, 2, num_warps)), (_conv_consumer_1, (p, )), (_conv_load, (p, ))],
                           [4, 4], [MMA_REGS, LOAD_REGS])


def smem_bytes(bh: int, bw: int, bn: int, bk: int, stages: int, consumers: int) -> int:
    """Shared memory a config takes: the GEMM's for a tile of bh * bw rows (gemm_hopper.smem_bytes)."""
    return gemm_smem_bytes(bh * bw, bn, bk, stages, consumers)


def _desc(t, box):
    return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, GL_DTYPES[t.dtype]))


def phase_view(x_nhwc):
    """The stride-2 kernel's view of the NHWC input (N, H, W, C), even H and W, W's stride C: (N, H / 2, 2,
    W / 2, 2 * C), pixel (2 * h2 + hp, 2 * w2 + wp) at (h2, hp, w2, wp * C + c)."""
    N, H, W, C = x_nhwc.shape
    sn, sh, _, _ = x_nhwc.stride()
    return x_nhwc.as_strided((N, H // 2, 2, W // 2, 2 * C), (sn, 2 * sh, sh, 2 * C, 1))


def descriptors(x_nhwc, weight2d, res_nhwc, out_nhwc, bh: int, bw: int, bn: int, bk: int, stride: int = 1):
    """The kernel's four descriptors: x (N, H, W, C) (stride 2: its phase_view), the packed weight as (K, R*S*C),
    the residual and the output (N, OH, OW, K) (res: the output's without a residual)."""
    out_desc = _desc(out_nhwc, [1, bh, bw, bn])
    x_desc = _desc(x_nhwc, [1, bh, bw, bk]) if stride == 1 else _desc(phase_view(x_nhwc), [1, bh, 1, bw, bk])
    return (x_desc, _desc(weight2d, [bn, bk]), out_desc,
            _desc(res_nhwc, [1, bh, bw, bn]) if res_nhwc is not None else out_desc)


__all__ = ["conv_ws_kernel", "descriptors", "phase_view", "smem_bytes"]
