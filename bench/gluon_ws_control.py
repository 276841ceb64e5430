"""Controls for compute-sanitizer's racecheck on the warp-specialized kernels: Gluon kernels whose
4-warp partitions use no shared memory of their own, each writing its part of a row. A hazard
racecheck reports in them is Triton's warp_specialize hand-off (the state bytes its default warps
write and the worker warps read between named barriers), not a kernel's pipeline. Two: one worker
partition (the hand-off stores 4 state bytes) and three (12 bytes, as the attention kernel with
three softmax warpgroups: racecheck flagged the hand-off in the kernels with two or three workers,
not in the one-worker control). bench/gluon_smoke.py --kernel control runs them (the device: Gluon
needs a GPU)."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _part(out_ptr, base: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 128, layout)
    gl.store(out_ptr + gl.program_id(0) * 512 + base + offs, offs.to(gl.float32) + base)


@gluon.jit
def control_kernel(out_ptr):
    gl.warp_specialize([(_part, (out_ptr, 0)), (_part, (out_ptr, 128))], [4], [40])


@gluon.jit
def control3_kernel(out_ptr):
    gl.warp_specialize([(_part, (out_ptr, 0)), (_part, (out_ptr, 128)), (_part, (out_ptr, 256)),
                        (_part, (out_ptr, 384))], [4, 4, 4], [40, 40, 40])


def run(rows: int = 8, workers: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's output, what it must be): the control with one worker partition or three."""
    width = 128 * (workers + 1)
    out = torch.empty(rows, 512, device="cuda")
    (control_kernel if workers == 1 else control3_kernel)[(rows,)](out, num_warps=4)
    return out[:, :width], torch.arange(width, device="cuda", dtype=torch.float32).expand(rows, width)
