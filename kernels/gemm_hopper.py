"""accelc::linear on Hopper (sm90): persistent, warp-specialized Gluon GEMMs with the fused epilogue.

The same op as kernels/gemm.py (out = act(x @ weight^T + bias) (+ residual), fp16 / bf16, fp32
accumulators), written in Gluon (triton.experimental.gluon) because Triton's `tl` cannot say what
cuBLAS does on Hopper: one producer warp feeding the tensor cores through the copy engine, and
consumer warpgroups that never wait for memory. The design follows Triton's Gluon tutorials
(05-wgmma, 07-persistence, 08-warp-specialization) and CUTLASS's sm90 "ping-pong" kernel:

- persistent: one CTA per SM walks its output tiles (tile, tile + #CTAs, ...), in GROUP_M groups of
  row blocks so that the CTAs running together share weight tiles in L2 (primitives.tile_coords);
- a **load partition** (one warp, 40 registers; a warpgroup beside two consumers, see below) streams
  x and weight K-slices by TMA into a ring of
  STAGES shared-memory buffers; `ready[s]` says a slot is full (the copy engine's byte count),
  `empty[s]` that its MMA finished. Beside two 4-warp consumers it takes 4 warps: Triton 3.6 pads
  the 4 + 4 + 1 warps to 12 and hands one padding warp the load partition's code as well, so two
  warps issued every load and the ring's barriers broke ("unspecified launch failure" as soon as the
  second consumer had a tile; a 4-warp load partition has no padding, and its loads are issued by
  one elected thread);
- CONSUMERS **MMA partitions** of 4 warps (one warpgroup) each take every CONSUMERS-th tile of the
  CTA. Each runs async wgmma over the ring, one MMA in flight behind the newest, releasing a slot
  as soon as its MMA retires, then its own epilogue: bias, activation and residual in fp32
  registers (epilogue.finish, shared with the `tl` kernels), the residual tile brought in by TMA
  into the consumer's output buffer during the main loop, and the result written back by a TMA
  store. With two consumers, one's epilogue runs while the other's MMAs keep the tensor cores
  busy: the ring hands consecutive tiles' slots to alternating consumers, which is what gives
  the ping-pong its order.

A second kernel, linear_coop_kernel (the end of this file), runs cuBLAS's one-wave tiles (192 x 192,
192 x 96, 128 x 192), which Triton's power-of-two tensors cannot hold as one accumulator: two or three
MMA warpgroups share a tile ("cooperative"), each owning 64 rows in two accumulators of power-of-two
widths. The launcher races both kernels' candidates with the `tl` kernel's.

Every operand must be one the copy engine can take (primitives.tma_ok: 16-byte aligned rows and base,
contiguous last dim); the launcher (gemm.launch) sends everything else to the `tl` kernel, which
is also the CPU-interpreter path and the reference these kernels are tested against. The weight is
read as stored: (N, K) boxes (nn.Linear) or (K, N) boxes of weight^T (W_T: GPT-2's Conv1D).
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from accelc.kernels.epilogue import finish
from accelc.kernels.hopper_args import CoopArgs, WsArgs
from accelc.kernels.primitives import tile_coords

GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.int8: gl.int8,
             torch.float8_e4m3fn: gl.float8e4nv}

# The copy engine's two calls, as Triton 3.6 (the device's) and 3.7+ (renamed: async_load /
# async_store; the old names raise there) spell them.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _tile_counts(M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    return gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), gl.cdiv(K, BLOCK_K)


@gluon.jit
def ring_slot(step, STAGES: gl.constexpr):
    """(slot, phase) of the ring's step-th fill: its slot, and the phase its `ready` barrier completes (its
    `empty` barrier's, for the producer's wait, is the other one: a slot starts empty)."""
    return step % STAGES, (step // STAGES) & 1


@gluon.jit
def ring_release(empty, step, STAGES: gl.constexpr, pred):
    """A consumer gives back the slot of the fill before its step-th (its MMA has read it), where pred."""
    mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=pred)


@gluon.jit
def _load_partition(p):
    """The producer: TMA loads of every K-slice of every tile of this CTA into the ring, in order."""
    num_pid_m, num_pid_n, k_tiles = _tile_counts(p.M, p.N, p.K, p.BLOCK_M, p.BLOCK_N, p.BLOCK_K)
    step = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, p.GROUP_M)
        for kk in range(k_tiles):
            slot, phase = ring_slot(step, p.STAGES)
            # a slot starts empty: the first wait of each (phase 1) passes at once
            mbarrier.wait(p.empty.index(slot), phase ^ 1)
            bar = p.ready.index(slot)
            mbarrier.expect(bar, p.x_desc.block_type.nbytes + p.w_desc.block_type.nbytes)
            tma_load(p.x_desc, [pid_m * p.BLOCK_M, kk * p.BLOCK_K], bar, p.x_bufs.index(slot))
            if p.W_T:
                tma_load(p.w_desc, [kk * p.BLOCK_K, pid_n * p.BLOCK_N], bar, p.w_bufs.index(slot))
            else:
                tma_load(p.w_desc, [pid_n * p.BLOCK_N, kk * p.BLOCK_K], bar, p.w_bufs.index(slot))
            step += 1


@gluon.jit
def _mma_partition(p, CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, WARPS: gl.constexpr):
    """A consumer: wgmma over the ring for its tiles, then the epilogue and the TMA store."""
    BLOCK_M: gl.constexpr = p.BLOCK_M
    BLOCK_N: gl.constexpr = p.BLOCK_N
    QUANT: gl.constexpr = p.QUANT
    # the accumulator: wgmma's own register layout, instructions 64 x BLOCK_N x (32 bytes) per
    # warpgroup; int8 operands (QUANT 1) sum into int32 on the int8 tensor cores, exactly, fp8 ones (QUANT 2)
    # into fp32 (Triton's one-byte wgmma goes up to 128 columns an instruction: 256 asserts in its int8 lowering)
    INSTR_K: gl.constexpr = 32 if QUANT else 16
    INSTR_N: gl.constexpr = 128 if QUANT and BLOCK_N > 128 else BLOCK_N
    ACC_DTYPE: gl.constexpr = gl.int32 if QUANT == 1 else gl.float32
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, INSTR_N, INSTR_K])
    num_pid_m, num_pid_n, k_tiles = _tile_counts(p.M, p.N, p.K, BLOCK_M, BLOCK_N, p.BLOCK_K)
    c_buf = p.c_bufs.index(CONSUMER)
    res_bar = p.res_ready.index(CONSUMER)
    step = CONSUMER * k_tiles      # the ring position of this consumer's first tile
    done = 0
    for tile in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), num_pid_m * num_pid_n,
                      CONSUMERS * gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, p.GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if p.HAS_RESIDUAL:
            # the residual tile lands in the output buffer while the MMAs run (the last tile's
            # store must have left it first)
            tma.store_wait(0)
            mbarrier.expect(res_bar, p.res_desc.block_type.nbytes)
            tma_load(p.res_desc, [off_m, off_n], res_bar, c_buf)

        if CONSUMERS == 2:
            # Take turns on the ring: a barrier's phase says only "odd" or "even", so a consumer
            # that waited on slots two fills ahead of the other would take that one's data for
            # its own. This consumer starts its K loop only once the other has waited for all of
            # its previous tile's slots; the other's MMAs and epilogue still overlap this one.
            mbarrier.wait(p.turn.index(CONSUMER), (done + CONSUMER + 1) & 1, pred=done + CONSUMER > 0)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE, layout=acc_layout)
        for kk in range(k_tiles):
            slot, phase = ring_slot(step, p.STAGES)
            mbarrier.wait(p.ready.index(slot), phase)
            if p.W_T:
                acc = warpgroup_mma(p.x_bufs.index(slot), p.w_bufs.index(slot), acc, is_async=True)
            else:
                acc = warpgroup_mma(p.x_bufs.index(slot), p.w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            # at most this MMA in flight: the previous one has read its slot, which goes back
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            ring_release(p.empty, step, p.STAGES, kk > 0)
            step += 1
        if CONSUMERS == 2:
            mbarrier.arrive(p.turn.index(1 - CONSUMER))    # the other consumer's turn
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        ring_release(p.empty, step, p.STAGES, k_tiles > 0)
        step += (CONSUMERS - 1) * k_tiles     # the other consumers' tiles

        if QUANT:
            # W8A8's (int8 or fp8) dequantization, as the tl kernel's: acc * a_scale[row] * w_scale[column] in fp32
            offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            a_s = gl.load(p.a_scale_ptr + offs_m, mask=offs_m < p.M, other=0.0)
            w_s = gl.load(p.w_scale_ptr + offs_n, mask=offs_n < p.N, other=0.0)
            accf = acc.to(gl.float32) * gl.expand_dims(a_s, 1) * gl.expand_dims(w_s, 0)
        else:
            accf = acc
        # int8 layers with half outputs take GELU in its tanh form on the SFU, as the tl kernel does
        finish_tile(accf, p.bias_ptr, off_n, p.N, c_buf, res_bar, done, acc_layout, p.HAS_BIAS, p.HAS_RESIDUAL,
                    p.RESIDUAL_FIRST, p.ACTIVATION, QUANT == 1)
        # the copy engine clips the rows and columns past M and N
        tma_store(p.out_desc, [off_m, off_n], c_buf)
        done += 1
    tma.store_wait(0)


@gluon.jit
def finish_tile(acc, bias_ptr, n0, N, c_buf, res_bar, done, acc_layout: gl.constexpr, HAS_BIAS: gl.constexpr,
                HAS_RESIDUAL: gl.constexpr, RESIDUAL_FIRST: gl.constexpr, ACTIVATION: gl.constexpr,
                FAST_MATH: gl.constexpr):
    """A consumer's epilogue into its output buffer c_buf, ready for the TMA store: bias (columns n0..), the
    residual tile its TMA load brought into c_buf (its `done`-th, on res_bar; without one, the last tile's
    store must have left c_buf first), activation (epilogue.finish, the tl kernels' arithmetic). Also the
    Gluon conv's (kernels/conv_hopper.py)."""
    if HAS_BIAS:
        offs_n = n0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc_layout))
        bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
    else:
        bias = None
    if HAS_RESIDUAL:
        mbarrier.wait(res_bar, done & 1)
        res = c_buf.load(acc_layout)
    else:
        res = None
        tma.store_wait(0)
    out = finish(acc, bias, res, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, FAST_MATH, True)
    c_buf.store(out.to(c_buf.dtype))
    fence_async_shared()


@gluon.jit
def _consumer_1(p):
    _mma_partition(p, 1, 2, 4)


@gluon.jit
def allocate_ring(x_desc, w_desc, out_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """The warp-specialized loop's shared memory, (x_bufs, w_bufs, c_bufs): STAGES slots of the x and weight
    boxes, one output box per consumer; and its barriers, initialised, (ready, empty, res_ready, turn): per
    slot, full and free; per consumer, its residual box landed and its turn on the ring. Also the Gluon
    conv's (kernels/conv_hopper.py), whose boxes are 4-D."""
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_bufs = gl.allocate_shared_memory(out_desc.dtype, [CONSUMERS] + out_desc.block_type.shape, out_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    res_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(CONSUMERS):
        mbarrier.init(res_ready.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    return (x_bufs, w_bufs, c_bufs), (ready, empty, res_ready, turn)


@gluon.jit(do_not_specialize=["M"])  # sizes that follow the batch or length: one binary for every size
def linear_ws_kernel(
    # TMA descriptors (res_desc: the output's when there is no residual), the bias pointer and W8A8's
    # scales (a_scale (M,), w_scale (N,) fp32; any pointer without QUANT)
    x_desc, w_desc, out_desc, res_desc, bias_ptr, a_scale_ptr, w_scale_ptr,
    # sizes
    M, N, K,
    # epilogue; QUANT: 0 float; 1 int8 x and weight, 2 fp8 (e4m3) ones, the accumulators dequantized by the two
    # scales (W8A8)
    HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, RESIDUAL_FIRST: gl.constexpr, ACTIVATION: gl.constexpr,
    QUANT: gl.constexpr,
    # meta-parameters (tile sizes come with the descriptors' boxes)
    W_T: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr,
    LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    bufs, bars = allocate_ring(x_desc, w_desc, out_desc, STAGES, CONSUMERS)   # (one level a line: triton 3.6's
    x_bufs, w_bufs, c_bufs = bufs                                             # cache key fails on nested targets)
    ready, empty, res_ready, turn = bars
    p = WsArgs(x_desc, w_desc, out_desc, res_desc, x_bufs, w_bufs, c_bufs, ready, empty, res_ready, turn,
               bias_ptr, a_scale_ptr, w_scale_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M,
               HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, QUANT, W_T)
    if CONSUMERS == 1:
        gl.warp_specialize([(_mma_partition, (p, 0, 1, num_warps)), (_load_partition, (p, ))], [1], [LOAD_REGS])
    else:
        gl.warp_specialize([(_mma_partition, (p, 0, 2, num_warps)), (_consumer_1, (p, )), (_load_partition, (p, ))],
                           [4, 4], [MMA_REGS, LOAD_REGS])


def smem_bytes(bm: int, bn: int, bk: int, stages: int, consumers: int, elem: int = 2) -> int:
    """Shared memory a config takes: the ring (operands of `elem` bytes: 1 for W8A8), one half-precision
    output tile per consumer, the barriers."""
    return stages * (bm + bn) * bk * elem + consumers * bm * bn * 2 + (2 * stages + 2 * consumers) * 8


def _desc(t, box):
    """A TMA descriptor of t with `box`, in the shared-memory layout wgmma reads."""
    return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, GL_DTYPES[t.dtype]))


def descriptors(x2, weight, res2, out, bm: int, bn: int, bk: int, w_t: bool):
    """The kernel's four TMA descriptors (the config's boxes); res_desc is the output's without a residual."""
    w_desc = _desc(weight.t(), [bk, bn]) if w_t else _desc(weight, [bn, bk])
    out_desc = _desc(out, [bm, bn])
    return _desc(x2, [bm, bk]), w_desc, out_desc, (_desc(res2, [bm, bn]) if res2 is not None else out_desc)


# ---------------------------------------------------------------------------------------------------
# Tiles of any multiple of 64 rows and two column widths: cuBLAS's one-wave tiles.
#
# cuBLAS runs BERT's and ViT's 768-wide layers in tiles of 192 x 96 or 192 x 192 (nvjet, H100): 3072 x
# 768 is then 128 tiles and 6304 x 768 exactly 132, one wave on 132 SMs, where power-of-two tiles
# give 1.1-2.3 waves. Triton's tensors are powers of two, so such a tile is assembled: WGS MMA
# warpgroups ("cooperative": all on one tile), each owning 64 rows, each holding two accumulators
# of BN1 and BN2 columns (128 + 64 = 192, 64 + 32 = 96), loaded and stored as
# boxes of those sizes. One load warpgroup feeds a ring of STAGES slots: WGS row boxes of x and the
# two column boxes of the weight; a slot goes back once all WGS warpgroups' MMAs have read it.
# ---------------------------------------------------------------------------------------------------


@gluon.jit
def _coop_load(p):
    BLOCK_M: gl.constexpr = 64 * p.WGS
    BN1: gl.constexpr = p.BN1
    BLOCK_K: gl.constexpr = p.BLOCK_K
    num_pid_m, num_pid_n, k_tiles = _tile_counts(p.M, p.N, p.K, BLOCK_M, BN1 + p.BN2, BLOCK_K)
    nbytes: gl.constexpr = (p.WGS * p.x_desc.block_type.nbytes + p.w1_desc.block_type.nbytes
                            + p.w2_desc.block_type.nbytes)
    step = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, p.GROUP_M)
        off_n = pid_n * (BN1 + p.BN2)
        for kk in range(k_tiles):
            slot, phase = ring_slot(step, p.STAGES)
            mbarrier.wait(p.empty.index(slot), phase ^ 1)
            bar = p.ready.index(slot)
            mbarrier.expect(bar, nbytes)
            # (boxes wholly past M or N are filled with zeros and still count their bytes)
            for g in gl.static_range(p.WGS):
                tma_load(p.x_desc, [pid_m * BLOCK_M + 64 * g, kk * BLOCK_K], bar, p.x_bufs.index(slot * p.WGS + g))
            if p.W_T:
                tma_load(p.w1_desc, [kk * BLOCK_K, off_n], bar, p.w1_bufs.index(slot))
                tma_load(p.w2_desc, [kk * BLOCK_K, off_n + BN1], bar, p.w2_bufs.index(slot))
            else:
                tma_load(p.w1_desc, [off_n, kk * BLOCK_K], bar, p.w1_bufs.index(slot))
                tma_load(p.w2_desc, [off_n + BN1, kk * BLOCK_K], bar, p.w2_bufs.index(slot))
            step += 1


@gluon.jit
def _coop_b(buf, W_T: gl.constexpr):
    """A weight box as wgmma's B operand (K x N): (K, N) boxes as they are, (N, K) ones transposed."""
    if W_T:
        return buf
    else:
        return buf.permute((1, 0))


@gluon.jit
def _coop_epilogue(acc, out_desc, c_buf, bias_ptr, row, col, N, WIDTH: gl.constexpr, HAS_BIAS: gl.constexpr,
                   HAS_RESIDUAL: gl.constexpr, RESIDUAL_FIRST: gl.constexpr, ACTIVATION: gl.constexpr):
    """One accumulator's epilogue (its residual already in c_buf) and its TMA store. (linear_ws_kernel's
    consumer writes the same steps inline, its bias load ahead of the residual's wait.)"""
    layout: gl.constexpr = acc.type.layout
    if HAS_BIAS:
        offs_n = col + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
        bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
    else:
        bias = None
    if HAS_RESIDUAL:
        res = c_buf.load(layout)
    else:
        res = None
    out = finish(acc, bias, res, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, False, True)
    c_buf.store(out.to(out_desc.dtype))
    fence_async_shared()
    # the copy engine clips the rows and columns past M and N
    tma_store(out_desc, [row, col], c_buf)


@gluon.jit
def _coop_mma(p, G: gl.constexpr):
    """MMA warpgroup G: rows 64 G .. 64 G + 63 of every tile of this CTA, both accumulators, then their
    epilogues."""
    BLOCK_M: gl.constexpr = 64 * p.WGS
    BN1: gl.constexpr = p.BN1
    BN2: gl.constexpr = p.BN2
    l1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN1, 16])
    l2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                 instr_shape=[16, BN2, 16])
    num_pid_m, num_pid_n, k_tiles = _tile_counts(p.M, p.N, p.K, BLOCK_M, BN1 + BN2, p.BLOCK_K)
    c1 = p.c1_bufs.index(G)
    c2 = p.c2_bufs.index(G)
    res_bar = p.res_ready.index(G)
    step = 0
    done = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, p.GROUP_M)
        row = pid_m * BLOCK_M + 64 * G
        col = pid_n * (BN1 + BN2)
        if p.HAS_RESIDUAL:
            # the residual lands in c1 / c2 while the MMAs run (the last tile's stores must have left them)
            tma.store_wait(0)
            mbarrier.expect(res_bar, p.res1_desc.block_type.nbytes + p.res2_desc.block_type.nbytes)
            tma_load(p.res1_desc, [row, col], res_bar, c1)
            tma_load(p.res2_desc, [row, col + BN1], res_bar, c2)
        acc1 = gl.zeros((64, BN1), dtype=gl.float32, layout=l1)
        acc2 = gl.zeros((64, BN2), dtype=gl.float32, layout=l2)
        for kk in range(k_tiles):
            slot, phase = ring_slot(step, p.STAGES)
            mbarrier.wait(p.ready.index(slot), phase)
            a = p.x_bufs.index(slot * p.WGS + G)
            acc1 = warpgroup_mma(a, _coop_b(p.w1_bufs.index(slot), p.W_T), acc1, is_async=True)
            acc2 = warpgroup_mma(a, _coop_b(p.w2_bufs.index(slot), p.W_T), acc2, is_async=True)
            # this K-slice's two MMAs in flight: the last slice's have read their slot
            acc1, acc2 = warpgroup_mma_wait(2, deps=(acc1, acc2))
            ring_release(p.empty, step, p.STAGES, kk > 0)
            step += 1
        acc1, acc2 = warpgroup_mma_wait(0, deps=(acc1, acc2))
        ring_release(p.empty, step, p.STAGES, k_tiles > 0)
        if p.HAS_RESIDUAL:
            mbarrier.wait(res_bar, done & 1)
        else:
            tma.store_wait(0)
        _coop_epilogue(acc1, p.out1_desc, c1, p.bias_ptr, row, col, p.N, BN1, p.HAS_BIAS, p.HAS_RESIDUAL,
                       p.RESIDUAL_FIRST, p.ACTIVATION)
        _coop_epilogue(acc2, p.out2_desc, c2, p.bias_ptr, row, col + BN1, p.N, BN2, p.HAS_BIAS, p.HAS_RESIDUAL,
                       p.RESIDUAL_FIRST, p.ACTIVATION)
        done += 1
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["M"])  # sizes that follow the batch or length: one binary for every size
def linear_coop_kernel(
    # TMA descriptors: x (64-row boxes), the weight's two column boxes, the output's and the residual's
    # two boxes (a residual's: the output's when there is none)
    x_desc, w1_desc, w2_desc, out1_desc, out2_desc, res1_desc, res2_desc, bias_ptr,
    M, N, K,
    HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, RESIDUAL_FIRST: gl.constexpr, ACTIVATION: gl.constexpr,
    W_T: gl.constexpr, BN2: gl.constexpr, WGS: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
    LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    gl.static_assert(WGS == 2 or WGS == 3, "two or three MMA warpgroups")
    gl.static_assert(BN2 > 0, "two column boxes")
    dtype: gl.constexpr = x_desc.dtype
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BN1: gl.constexpr = out1_desc.block_type.shape[1]
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES * WGS] + x_desc.block_type.shape, x_desc.layout)
    w1_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w1_desc.block_type.shape, w1_desc.layout)
    w2_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w2_desc.block_type.shape, w2_desc.layout)
    c1_bufs = gl.allocate_shared_memory(out1_desc.dtype, [WGS] + out1_desc.block_type.shape, out1_desc.layout)
    c2_bufs = gl.allocate_shared_memory(out2_desc.dtype, [WGS] + out2_desc.block_type.shape, out2_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    res_ready = gl.allocate_shared_memory(gl.int64, [WGS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=WGS)      # every MMA warpgroup gives the slot back
    for i in gl.static_range(WGS):
        mbarrier.init(res_ready.index(i), count=1)
    p = CoopArgs(x_desc, w1_desc, w2_desc, out1_desc, out2_desc, res1_desc, res2_desc, x_bufs, w1_bufs, w2_bufs,
                 c1_bufs, c2_bufs, ready, empty, res_ready, bias_ptr, M, N, K, BLOCK_K, BN1, BN2, WGS, STAGES, GROUP_M,
                 HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, W_T)
    if WGS == 2:
        gl.warp_specialize([(_coop_mma, (p, 0)), (_coop_mma, (p, 1)), (_coop_load, (p, ))], [4, 4],
                           [MMA_REGS, LOAD_REGS])
    else:
        gl.warp_specialize([(_coop_mma, (p, 0)), (_coop_mma, (p, 1)), (_coop_mma, (p, 2)), (_coop_load, (p, ))],
                           [4, 4, 4], [MMA_REGS, MMA_REGS, LOAD_REGS])


def coop_smem_bytes(wgs: int, bn1: int, bn2: int, bk: int, stages: int, elem: int = 2) -> int:
    """Shared memory of a linear_coop_kernel config: the ring, each warpgroup's output boxes, barriers."""
    return stages * (64 * wgs + bn1 + bn2) * bk * elem + wgs * 64 * (bn1 + bn2) * elem + (2 * stages + wgs) * 8


def coop_descriptors(x2, weight, res2, out, bn1: int, bn2: int, bk: int, w_t: bool):
    """linear_coop_kernel's seven TMA descriptors (see its signature)."""
    widths = (bn1, bn2)
    ws = [_desc(weight.t(), [bk, w]) if w_t else _desc(weight, [w, bk]) for w in widths]
    outs = [_desc(out, [64, w]) for w in widths]
    res = [_desc(res2, [64, w]) for w in widths] if res2 is not None else outs
    return (_desc(x2, [64, bk]), *ws, *outs, *res)
