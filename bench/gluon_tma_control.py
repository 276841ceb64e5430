"""Controls for compute-sanitizer's racecheck on the Gluon conv (kernels/conv_hopper.py), which racecheck
cannot run: on every candidate it stops with "The Sanitizer failed to handle a hardware exception" and an
illegal address, where the plain run, memcheck and synccheck pass (bench/results/gemm_hopper-notes.md, fifth
step). The GEMM, whose boxes are 2-D, runs under racecheck. Each control is one small kernel, no
warp_specialize, one CTA per image of an (N, 8, 16, 64) fp16 NHWC tensor, and differs from the one before in
one thing the conv does:

  2d      a (128, 64) TMA box in, the same box out (the GEMM's boxes)
  4d      a (1, 8, 16, 64) box of the 4-D NHWC view in and out (the conv's input and output boxes)
  4d-pad  the 4-D box shifted one pixel up and left: the copy engine zero-fills the padding (the conv's taps)
  5d      the stride-2 conv's 5-D phase view, (1, 4, 1, 8, 64) boxes
  4d-mma  the 4-D box in, read by wgmma through the reshaped descriptor as the (128, 64) operand, x @ x^T's
          (128, 128) product stored by a 2-D box (the conv's consumers)
  4d-mma-out  the same, the product (fp16) written to a 4-D (1, 8, 16, 128) shared box through a reshape and
          stored by a 4-D box (the conv's epilogue)
  4d-mma-ring  the same, the input in slot 1 of a two-slot ring of 4-D boxes (the conv's ring)
  ws-2d-mma, ws-4d-mma, ws-4d-mma-out  4d-mma / 4d-mma-out split as the conv is: a 1-warp load partition
          (warp_specialize) brings the box (2-D: the GEMM's), the default partition multiplies and stores

    python bench/gluon_tma_control.py MODE          # on the device; prints the error against torch
    compute-sanitizer --tool racecheck python bench/gluon_tma_control.py MODE
"""
from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
MODES = ("2d", "4d", "4d-pad", "5d", "4d-mma", "4d-mma-out", "4d-mma-ring", "ws-2d-mma", "ws-4d-mma", "ws-4d-mma-out")


@gluon.jit
def copy_kernel(in_desc, out_desc, RANK: gl.constexpr, SHIFT: gl.constexpr):
    buf = gl.allocate_shared_memory(in_desc.dtype, in_desc.block_type.shape, in_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    image = gl.program_id(0)
    mbarrier.expect(bar, in_desc.block_type.nbytes)
    if RANK == 2:
        tma_load(in_desc, [image * 128, 0], bar, buf)
    elif RANK == 4:
        tma_load(in_desc, [image, -SHIFT, -SHIFT, 0], bar, buf)
    else:
        tma_load(in_desc, [image, 0, 1, 0, 64], bar, buf)
    mbarrier.wait(bar, 0)
    if RANK == 2:
        tma_store(out_desc, [image * 128, 0], buf)
    elif RANK == 4:
        tma_store(out_desc, [image, 0, 0, 0], buf)
    else:
        tma_store(out_desc, [image, 0, 1, 0, 64], buf)
    tma.store_wait(0)
    mbarrier.invalidate(bar)


@gluon.jit
def _mma_store(buf, out_desc, c_box, OUT4: gl.constexpr, WARPS: gl.constexpr):
    """x @ x^T of the box in buf, read by wgmma through the reshaped descriptor, stored by the copy engine (OUT4:
    written to the 4-D box through a reshape, as the conv's epilogue does)."""
    a = buf.reshape([128, 64])
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, 128, 16])
    acc = warpgroup_mma(a, a.permute((1, 0)), gl.zeros((128, 128), dtype=gl.float32, layout=layout), is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    if OUT4:
        c_box.reshape([128, 128]).store(acc.to(out_desc.dtype))
        fence_async_shared()   # the stores visible to the copy engine, as in gemm_hopper's epilogue
        tma_store(out_desc, [gl.program_id(0), 0, 0, 0], c_box)
    else:
        c_box.store(acc)
        fence_async_shared()
        tma_store(out_desc, [gl.program_id(0) * 128, 0], c_box)
    tma.store_wait(0)


@gluon.jit
def mma_kernel(in_desc, out_desc, OUT4: gl.constexpr, RING: gl.constexpr, num_warps: gl.constexpr):
    ring = gl.allocate_shared_memory(in_desc.dtype, [2] + in_desc.block_type.shape, in_desc.layout)
    buf = ring.index(RING)
    c_box = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    image = gl.program_id(0)
    mbarrier.expect(bar, in_desc.block_type.nbytes)
    tma_load(in_desc, [image, 0, 0, 0], bar, buf)
    mbarrier.wait(bar, 0)
    _mma_store(buf, out_desc, c_box, OUT4, num_warps)
    mbarrier.invalidate(bar)


@gluon.jit
def _ws_load(in_desc, ring, bar):
    mbarrier.expect(bar, in_desc.block_type.nbytes)
    if len(in_desc.block_type.shape) == 2:
        tma_load(in_desc, [gl.program_id(0) * 128, 0], bar, ring.index(0))
    else:
        tma_load(in_desc, [gl.program_id(0), 0, 0, 0], bar, ring.index(0))


@gluon.jit
def _ws_mma(out_desc, ring, c_box, bar, OUT4: gl.constexpr, WARPS: gl.constexpr):
    mbarrier.wait(bar, 0)
    _mma_store(ring.index(0), out_desc, c_box, OUT4, WARPS)


@gluon.jit
def ws_kernel(in_desc, out_desc, OUT4: gl.constexpr, num_warps: gl.constexpr):
    ring = gl.allocate_shared_memory(in_desc.dtype, [2] + in_desc.block_type.shape, in_desc.layout)
    c_box = gl.allocate_shared_memory(out_desc.dtype, out_desc.block_type.shape, out_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    gl.warp_specialize([(_ws_mma, (out_desc, ring, c_box, bar, OUT4, num_warps)), (_ws_load, (in_desc, ring, bar))],
                       [1], [40])


def _desc(t, box):
    dtype = {torch.float16: gl.float16, torch.float32: gl.float32}[t.dtype]
    return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, dtype))


def run(mode: str, images: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's output, what it must be) for one control."""
    x = torch.randn(images, 8, 16, 64, device="cuda", dtype=torch.float16)
    if mode.startswith("ws-"):
        rows = x.reshape(images, 128, 64).float()
        want = (rows @ rows.transpose(1, 2)).reshape(images * 128, 128)
        src = _desc(x.view(-1, 64), [128, 64]) if mode == "ws-2d-mma" else _desc(x, [1, 8, 16, 64])
        if mode == "ws-4d-mma-out":
            out = torch.zeros(images, 8, 16, 128, device="cuda", dtype=torch.float16)
            ws_kernel[(images,)](src, _desc(out, [1, 8, 16, 128]), True, num_warps=4)
            return out.view(images * 128, 128), want
        out = torch.zeros(images * 128, 128, device="cuda", dtype=torch.float32)
        ws_kernel[(images,)](src, _desc(out, [128, 128]), False, num_warps=4)
        return out, want
    if mode.startswith("4d-mma"):
        rows = x.reshape(images, 128, 64).float()
        want = (rows @ rows.transpose(1, 2)).reshape(images * 128, 128)
        ring = int(mode == "4d-mma-ring")
        if mode == "4d-mma-out":
            out = torch.zeros(images, 8, 16, 128, device="cuda", dtype=torch.float16)
            mma_kernel[(images,)](_desc(x, [1, 8, 16, 64]), _desc(out, [1, 8, 16, 128]), True, ring, num_warps=4)
            return out.view(images * 128, 128), want
        out = torch.zeros(images * 128, 128, device="cuda", dtype=torch.float32)
        mma_kernel[(images,)](_desc(x, [1, 8, 16, 64]), _desc(out, [128, 128]), False, ring, num_warps=4)
        return out, want
    out = torch.zeros_like(x)
    if mode == "2d":
        copy_kernel[(images,)](_desc(x.view(-1, 64), [128, 64]), _desc(out.view(-1, 64), [128, 64]), 2, 0)
        return out, x
    if mode.startswith("4d"):
        shift = 1 if mode == "4d-pad" else 0
        copy_kernel[(images,)](_desc(x, [1, 8, 16, 64]), _desc(out, [1, 8, 16, 64]), 4, shift)
        want = torch.zeros_like(x)
        want[:, shift:, shift:] = x[:, :8 - shift, :16 - shift]
        return out, want
    phase = [(images, 4, 2, 8, 128), (8 * 16 * 64, 2 * 16 * 64, 16 * 64, 128, 1)]    # conv_hopper.phase_view
    box = [1, 4, 1, 8, 64]
    copy_kernel[(images,)](_desc(x.as_strided(*phase), box), _desc(out.as_strided(*phase), box), 5, 0)
    want = torch.zeros_like(x)
    want[:, 1::2, 1::2] = x[:, 1::2, 1::2]     # the box: odd rows (phase 1), odd columns (channels 64-127)
    return out, want


if __name__ == "__main__":
    got, want = run(sys.argv[1])
    torch.cuda.synchronize()
    err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-30)
    print(f"{sys.argv[1]}: max relative error {err:.2e}")
    sys.exit(0 if err < 1e-3 else 1)
