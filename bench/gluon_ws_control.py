"""A control for compute-sanitizer's racecheck on the warp-specialized kernels: a Gluon kernel of two
4-warp partitions that use no shared memory of their own, each writing its half of a row. A hazard
racecheck reports in it is Triton's warp_specialize hand-off (the state byte its default warps write
and the worker warps read between named barriers), not a kernel's pipeline; bench/gluon_smoke.py
--kernel control runs it (the device: Gluon needs a GPU)."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _part(out_ptr, base: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout)
    gl.store(out_ptr + gl.program_id(0) * 256 + base + offs, offs.to(gl.float32) + base)


@gluon.jit
def control_kernel(out_ptr):
    gl.warp_specialize([(_part, (out_ptr, 0)), (_part, (out_ptr, 128))], [4], [40])


def run(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's output, what it must be)."""
    out = torch.empty(rows, 256, device="cuda")
    control_kernel[(rows,)](out, num_warps=4)
    return out, torch.arange(256, device="cuda", dtype=torch.float32).expand(rows, 256)
