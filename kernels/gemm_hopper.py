"""accelc::linear on Hopper (sm90): a persistent, warp-specialized Gluon GEMM with the fused epilogue.

The same op as kernels/gemm.py (out = act(x @ weight^T + bias) (+ residual), fp16 / bf16, fp32
accumulators), written in Gluon (triton.experimental.gluon) because Triton's `tl` cannot say what
cuBLAS does on Hopper: one producer warp feeding the tensor cores through the copy engine, and
consumer warpgroups that never wait for memory. The design follows Triton's Gluon tutorials
(05-wgmma, 07-persistence, 08-warp-specialization) and CUTLASS's sm90 "ping-pong" kernel:

- persistent: one CTA per SM walks its output tiles (tile, tile + #CTAs, ...), in GROUP_M groups of
  row blocks so that the CTAs running together share weight tiles in L2 (gemm.tile_coords);
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

Every operand must be one the copy engine can take (gemm.tma_ok: 16-byte aligned rows and base,
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
from accelc.kernels.gemm import tile_coords

GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}

# The copy engine's two calls, as Triton 3.6 (the device's) and 3.7+ (renamed: async_load /
# async_store; the old names raise there) spell them.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# A barrier of the calling partition's warps: Triton 3.6's thread_barrier, later versions' barrier.
partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@gluon.jit
def _tile_counts(M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    return gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), gl.cdiv(K, BLOCK_K)


@gluon.jit
def _load_slices(descs, bars, bufs, pid_m, pid_n, k0, k1, step, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 BLOCK_K: gl.constexpr, STAGES: gl.constexpr, W_T: gl.constexpr):
    """TMA loads of K-slices k0 .. k1 - 1 of one tile into the ring; returns the ring position after them."""
    x_desc, w_desc, _, _ = descs
    ready, empty, _, _ = bars
    x_bufs, w_bufs, _ = bufs
    for kk in range(k0, k1):
        slot = step % STAGES
        # a slot starts empty: the first wait of each (phase 1) passes at once
        mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma_load(x_desc, [pid_m * BLOCK_M, kk * BLOCK_K], bar, x_bufs.index(slot))
        if W_T:
            tma_load(w_desc, [kk * BLOCK_K, pid_n * BLOCK_N], bar, w_bufs.index(slot))
        else:
            tma_load(w_desc, [pid_n * BLOCK_N, kk * BLOCK_K], bar, w_bufs.index(slot))
        step += 1
    return step


@gluon.jit
def _load_partition(descs, bars, bufs, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, W_T: gl.constexpr):
    """The producer: TMA loads of every K-slice of every tile of this CTA into the ring, in order."""
    num_pid_m, num_pid_n, k_tiles = _tile_counts(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    step = 0
    for tile in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        step = _load_slices(descs, bars, bufs, pid_m, pid_n, 0, k_tiles, step, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                            W_T)


@gluon.jit
def _sk_start(cta, per, extra):
    """The first K-iteration (tile * k_tiles + kk, in tile order) of CTA `cta` in stream-K's even split:
    `per` iterations each, one more for the first `extra` CTAs."""
    return cta * per + min(cta, extra)


@gluon.jit
def _sk_piece(it, end, k_tiles):
    """The piece of one tile that starts at iteration `it` of a CTA whose run ends at `end`: (tile, k0, k1)."""
    tile = it // k_tiles
    k0 = it - tile * k_tiles
    return tile, k0, min(k_tiles, k0 + end - it)


@gluon.jit
def _load_partition_sk(descs, bars, bufs, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, W_T: gl.constexpr):
    """The stream-K producer: the K-slices of this CTA's share of all tiles' iterations, in order."""
    num_pid_m, num_pid_n, k_tiles = _tile_counts(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    ctas = gl.num_programs(0)
    total = num_pid_m * num_pid_n * k_tiles
    per = total // ctas
    extra = total % ctas
    it = _sk_start(gl.program_id(0), per, extra)
    end = _sk_start(gl.program_id(0) + 1, per, extra)
    step = 0
    while it < end:
        tile, k0, k1 = _sk_piece(it, end, k_tiles)
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        step = _load_slices(descs, bars, bufs, pid_m, pid_n, k0, k1, step, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, W_T)
        it += k1 - k0


@gluon.jit
def _mma_partition(descs, bars, bufs, bias_ptr, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                   CONSUMER: gl.constexpr, CONSUMERS: gl.constexpr, WARPS: gl.constexpr,
                   HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, RESIDUAL_FIRST: gl.constexpr,
                   ACTIVATION: gl.constexpr, W_T: gl.constexpr):
    """A consumer: wgmma over the ring for its tiles, then the epilogue and the TMA store."""
    _, _, out_desc, res_desc = descs
    _, empty, res_ready, turn = bars
    _, _, c_bufs = bufs
    # the accumulator: wgmma's own register layout, instructions 64 x BLOCK_N x 16 per warpgroup
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_pid_m, num_pid_n, k_tiles = _tile_counts(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    c_buf = c_bufs.index(CONSUMER)
    res_bar = res_ready.index(CONSUMER)
    step = CONSUMER * k_tiles      # the ring position of this consumer's first tile
    done = 0
    for tile in range(gl.program_id(0) + CONSUMER * gl.num_programs(0), num_pid_m * num_pid_n,
                      CONSUMERS * gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if HAS_RESIDUAL:
            # the residual tile lands in the output buffer while the MMAs run (the last tile's
            # store must have left it first)
            tma.store_wait(0)
            mbarrier.expect(res_bar, res_desc.block_type.nbytes)
            tma_load(res_desc, [off_m, off_n], res_bar, c_buf)

        if CONSUMERS == 2:
            # Take turns on the ring: a barrier's phase says only "odd" or "even", so a consumer
            # that waited on slots two fills ahead of the other would take that one's data for
            # its own. This consumer starts its K loop only once the other has waited for all of
            # its previous tile's slots; the other's MMAs and epilogue still overlap this one.
            mbarrier.wait(turn.index(CONSUMER), (done + CONSUMER + 1) & 1, pred=done + CONSUMER > 0)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        acc, step = _mma_slices(bars, bufs, acc, 0, k_tiles, step, STAGES, W_T)
        if CONSUMERS == 2:
            mbarrier.arrive(turn.index(1 - CONSUMER))    # the other consumer's turn
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k_tiles > 0)
        step += (CONSUMERS - 1) * k_tiles     # the other consumers' tiles
        _epilogue(acc, out_desc, c_buf, res_bar, bias_ptr, off_m, off_n, N, done, BLOCK_N, HAS_BIAS, HAS_RESIDUAL,
                  RESIDUAL_FIRST, ACTIVATION)
        done += 1
    tma.store_wait(0)


@gluon.jit
def _mma_slices(bars, bufs, acc, k0, k1, step, STAGES: gl.constexpr, W_T: gl.constexpr):
    """Async wgmma over K-slices k0 .. k1 - 1 from the ring, one MMA in flight behind the newest, each slot
    given back once the MMA after it is issued; the last one's slot is the caller's to give back (after
    its wait). Returns the accumulator (still in flight) and the ring position."""
    ready, empty, _, _ = bars
    x_bufs, w_bufs, _ = bufs
    for kk in range(k0, k1):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        if W_T:
            acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot), acc, is_async=True)
        else:
            acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        # at most this MMA in flight: the previous one has read its slot, which goes back
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=kk > k0)
        step += 1
    return acc, step


@gluon.jit
def _epilogue(acc, out_desc, c_buf, res_bar, bias_ptr, off_m, off_n, N, done, BLOCK_N: gl.constexpr,
              HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, RESIDUAL_FIRST: gl.constexpr,
              ACTIVATION: gl.constexpr):
    """Bias, activation and residual on a finished accumulator (the residual tile already on its way into
    c_buf: the consumer's `done`-th), then the tile to the output by TMA."""
    acc_layout: gl.constexpr = acc.type.layout
    if HAS_BIAS:
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        bias = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
    else:
        bias = None
    if HAS_RESIDUAL:
        mbarrier.wait(res_bar, done & 1)
        res = c_buf.load(acc_layout)
    else:
        res = None
        tma.store_wait(0)
    out = finish(acc, bias, res, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, False, True)
    c_buf.store(out.to(out_desc.dtype))
    fence_async_shared()
    # the copy engine clips the rows and columns past M and N
    tma_store(out_desc, [off_m, off_n], c_buf)


@gluon.jit
def _sk_offsets(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """Each accumulator element's place in a partial tile (row-major), in the accumulator's layout."""
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    return rows[:, None] * BLOCK_N + cols[None, :]


@gluon.jit
def _mma_partition_sk(descs, bars, bufs, bias_ptr, ws_ptr, flag_ptr, M, N, K, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                      WARPS: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
                      RESIDUAL_FIRST: gl.constexpr, ACTIVATION: gl.constexpr, W_T: gl.constexpr):
    """The stream-K consumer. Every CTA runs an even share of all tiles' K-iterations, so a tile may be
    split between consecutive CTAs. A CTA whose share starts inside a tile (that is its first piece)
    writes the partial sum to its fp32 slot of ws and raises its flag; the CTA that holds the tile's first
    K-slice (its last piece) adds the later CTAs' partials in CTA order (the same bits on every run), puts
    their flags back to 0, and runs the epilogue. The partials are written at the start of a CTA's run
    and read at the end of another's, so the wait is short; and a CTA only waits for later ones, which
    write theirs before they wait for anything."""
    _, _, out_desc, res_desc = descs
    _, empty, res_ready, _ = bars
    _, _, c_bufs = bufs
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_pid_m, num_pid_n, k_tiles = _tile_counts(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    cta = gl.program_id(0)
    ctas = gl.num_programs(0)
    total = num_pid_m * num_pid_n * k_tiles
    per = total // ctas
    extra = total % ctas
    it = _sk_start(cta, per, extra)
    end = _sk_start(cta + 1, per, extra)
    c_buf = c_bufs.index(0)
    res_bar = res_ready.index(0)
    step = 0
    done = 0
    while it < end:
        tile, k0, k1 = _sk_piece(it, end, k_tiles)
        pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if HAS_RESIDUAL and k0 == 0:
            tma.store_wait(0)
            mbarrier.expect(res_bar, res_desc.block_type.nbytes)
            tma_load(res_desc, [off_m, off_n], res_bar, c_buf)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        acc, step = _mma_slices(bars, bufs, acc, k0, k1, step, STAGES, W_T)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
        if k0 > 0:
            # the tail of a tile another CTA finishes: the partial to this CTA's slot, then the flag
            # (every thread's stores before one thread's release)
            gl.store(ws_ptr + cta * (BLOCK_M * BLOCK_N) + _sk_offsets(BLOCK_M, BLOCK_N, acc_layout), acc)
            partition_barrier()
            gl.atomic_xchg(flag_ptr + cta, 1, sem="release", scope="gpu")
        else:
            later = cta + 1
            covered = k1
            while covered < k_tiles:
                # later's first piece continues this tile: wait for its partial (taking the flag back)
                while gl.atomic_cas(flag_ptr + later, 1, 0, sem="acquire", scope="gpu") != 1:
                    pass
                acc += gl.load(ws_ptr + later * (BLOCK_M * BLOCK_N) + _sk_offsets(BLOCK_M, BLOCK_N, acc_layout),
                               cache_modifier=".cg")
                covered += per + (later < extra).to(gl.int32)
                later += 1
            _epilogue(acc, out_desc, c_buf, res_bar, bias_ptr, off_m, off_n, N, done, BLOCK_N, HAS_BIAS,
                      HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION)
            done += 1
        it += k1 - k0
    tma.store_wait(0)


@gluon.jit
def _consumer_1(descs, bars, bufs, bias_ptr, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, RESIDUAL_FIRST: gl.constexpr,
                ACTIVATION: gl.constexpr, W_T: gl.constexpr):
    _mma_partition(descs, bars, bufs, bias_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, 1, 2, 4,
                   HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, W_T)


@gluon.jit
def linear_ws_kernel(
    # TMA descriptors (res_desc: the output's when there is no residual) and the bias pointer
    x_desc, w_desc, out_desc, res_desc, bias_ptr,
    # stream-K only: fp32 partial tiles (a BLOCK_M x BLOCK_N slot a CTA) and the CTAs' flags (zeros)
    ws_ptr, flag_ptr,
    # sizes
    M, N, K,
    # epilogue
    HAS_BIAS: gl.constexpr, HAS_RESIDUAL: gl.constexpr, RESIDUAL_FIRST: gl.constexpr, ACTIVATION: gl.constexpr,
    # meta-parameters (tile sizes come with the descriptors' boxes)
    W_T: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr,
    STREAM_K: gl.constexpr, LOAD_REGS: gl.constexpr, MMA_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    dtype: gl.constexpr = x_desc.dtype
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
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

    descs = (x_desc, w_desc, out_desc, res_desc)
    bars = (ready, empty, res_ready, turn)
    bufs = (x_bufs, w_bufs, c_bufs)
    # (the argument tuples are written out: a tuple built with + passes its constexprs as values)
    if STREAM_K:
        gl.static_assert(CONSUMERS == 1, "stream-K runs one consumer")
        gl.warp_specialize([
            (_mma_partition_sk, (descs, bars, bufs, bias_ptr, ws_ptr, flag_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                 STAGES, GROUP_M, num_warps, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION,
                                 W_T)),
            (_load_partition_sk, (descs, bars, bufs, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, W_T)),
        ], [1], [LOAD_REGS])
    elif CONSUMERS == 1:
        gl.warp_specialize([
            (_mma_partition, (descs, bars, bufs, bias_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M,
                              0, 1, num_warps, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, W_T)),
            (_load_partition, (descs, bars, bufs, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, W_T)),
        ], [1], [LOAD_REGS])
    else:
        gl.warp_specialize([
            (_mma_partition, (descs, bars, bufs, bias_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M,
                              0, 2, num_warps, HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, W_T)),
            (_consumer_1, (descs, bars, bufs, bias_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M,
                           HAS_BIAS, HAS_RESIDUAL, RESIDUAL_FIRST, ACTIVATION, W_T)),
            (_load_partition, (descs, bars, bufs, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, W_T)),
        ], [4, 4], [MMA_REGS, LOAD_REGS])


SK_FLAG_SETS = 64     # flag sets a device keeps for stream-K launches (one per stream that launches one)
SK_MAX_CTAS = 256     # CTAs a stream-K launch may have (one per SM)
_sk_flags: dict = {}  # device index -> (flags (SK_FLAG_SETS, SK_MAX_CTAS) int32, {stream: its set})


def sk_flags(device: torch.device) -> torch.Tensor:
    """The stream-K flags of the current stream: zeros, and zeros again after every launch (each flag a
    finishing CTA takes back), so one set serves every launch of a stream in turn (a stream past the
    SK_FLAG_SETS-th shares a set with an earlier one). Made outside CUDA graph capture: a set zeroed
    inside one would be zeros only where that graph has run (the launcher makes them at a layer's
    first call, which accelc runs before it captures)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sk_flags:
        if torch.cuda.is_current_stream_capturing():
            raise ValueError("accelc::linear: the stream-K GEMM's flags are made by a call outside CUDA graph "
                             "capture; run the layer once before capturing it")
        _sk_flags[index] = (torch.zeros(SK_FLAG_SETS, SK_MAX_CTAS, dtype=torch.int32, device=device), {})
    flags, sets = _sk_flags[index]
    stream = torch.cuda.current_stream(device).cuda_stream
    if stream not in sets:
        sets[stream] = len(sets) % SK_FLAG_SETS
    return flags[sets[stream]]


def sk_buffers(device: torch.device, ctas: int, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stream-K launch's fp32 partial tiles (new each call: the caching allocator keeps streams and
    CUDA graphs apart) and its flags (sk_flags)."""
    if ctas > SK_MAX_CTAS:
        raise ValueError(f"accelc::linear: stream-K takes at most {SK_MAX_CTAS} CTAs, not {ctas}")
    return torch.empty(ctas * bm * bn, dtype=torch.float32, device=device), sk_flags(device)


def smem_bytes(bm: int, bn: int, bk: int, stages: int, consumers: int, elem: int = 2) -> int:
    """Shared memory a config takes: the ring, one output tile per consumer, the barriers."""
    return stages * (bm + bn) * bk * elem + consumers * bm * bn * elem + (2 * stages + 2 * consumers) * 8


def descriptors(x2, weight, res2, out, bm: int, bn: int, bk: int, w_t: bool):
    """The kernel's four TMA descriptors (the config's boxes); res_desc is the output's without a residual."""
    dt = GL_DTYPES[x2.dtype]

    def desc(t, box):
        return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, dt))

    w_desc = desc(weight.t(), [bk, bn]) if w_t else desc(weight, [bn, bk])
    out_desc = desc(out, [bm, bn])
    return desc(x2, [bm, bk]), w_desc, out_desc, (desc(res2, [bm, bn]) if res2 is not None else out_desc)
