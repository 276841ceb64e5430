"""Programmatic dependent launch (Hopper and later): a kernel launched with `launch_pdl` may start
while the kernel before it in the stream is still finishing, and waits (griddepcontrol.wait) for
that kernel's completion and its writes only where it is about to read them; the kernel before it
lets it start early (griddepcontrol.launch_dependents) once its own programs are all running.

A decode step is some fifteen kernels a layer of 1-20 us each, where the launch of each and the
ramp of its programs sat as idle GPU time between them (0.4 us gaps and the loads' first latency, in a
profile of a decode step). accelc's decode-path kernels (gemv_kernel, flash_decoding's
split kernel) launch this way: each reads what no kernel writes (its weights) before the wait, and
everything else after it; it writes only after it. The glue's kernels are launched without the
attribute and start as usual, after everything before them ends.

Off in Triton's interpreter, before sm90, where this Triton lacks the instructions, and with
ACCELC_PDL=0 (for measuring what it gives).

Inductor's own dependent launch (triton.enable_pdl) stays off for the glue: PyTorch leaves it
off by default; it showed nothing on ViT-B, and the 1.04x of a TinyLlama decode step was measured with
it and these kernels together, not split between them.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from accelc import runtime

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:          # a Triton without grid dependency control: enabled() is False
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """Before reading anything an earlier kernel writes (and before writing anything it may still
    read): wait for it; then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


LINES = tl.constexpr(16)     # 128-byte lines a row prefetch_rows asks for at each step of its loop


@triton.jit
def prefetch_rows(w_ptr, rows, stride_wn, stride_wk, K, START: tl.constexpr):
    """Ask L2 for `rows` of a row-major weight (stride_wk 1) from column START to K, one prefetch.global.L2 a
    128-byte line, before wait_for_producers: a kernel that starts while the one before it finishes (dependent
    launch) streams its weights in that kernel's tail, not after it. A hint: nothing waits for it, nothing
    faults (the columns past K ask for the row's first line again). Weights of another layout: nothing asked."""
    if stride_wk == 1:
        LINE: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth     # elements a 128-byte line
        offs = tl.arange(0, LINES) * LINE
        for k in range(START, K, LINES * LINE):
            cols = k + offs
            ptrs = w_ptr + rows[:, None] * stride_wn + tl.where(cols < K, cols, 0)[None, :]
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                      is_pure=False, pack=1)


def prefetching(device: torch.device) -> bool:
    """Whether the decode GEMVs prefetch their weights before waiting (prefetch_rows): with dependent launch, and
    ACCELC_PREFETCH_WEIGHTS=1. Off by default: measured, it slowed TinyLlama's decode and sped Qwen2-0.5B's (the
    results index's prefetch run); a whole slice asked for at once competes with the previous kernel's own weight
    stream where that one is still bandwidth-bound."""
    return enabled(device) and os.environ.get("ACCELC_PREFETCH_WEIGHTS", "0") not in ("", "0")


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch."""
    if gdc_wait is None or runtime.interpreted() or device.type != "cuda" or os.environ.get("ACCELC_PDL", "1") in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)
