"""Where the host time of one accelc::linear launch goes, layer by layer of Triton's launch path
(triton 3.x internals: for measuring, not for use). Prints microseconds per call; tiny shapes, so
the GPU keeps up.

    python bench/launch_breakdown.py
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402,F401  (registers the ops)
from accelc.kernels import gemm  # noqa: E402


def us(fn):
    return _common.per_call_us(fn, 3000, warmup=200)


def main():
    h = torch.float16
    x = torch.randn(16, 256, device="cuda", dtype=h)
    w = torch.randn(256, 256, device="cuda", dtype=h)
    b = torch.randn(256, device="cuda", dtype=h)
    o = torch.empty(16, 256, device="cuda", dtype=h)
    gemm.linear_launch(x, w, b, None, "gelu")
    (call, kw), = [v for k, v in gemm.TUNER.calls.items() if k[0] == (16, 256)]
    cfg = triton.Config({k: v for k, v in kw.items() if k.isupper()}, num_warps=kw["num_warps"],
                        num_stages=kw["num_stages"])
    meta = dict(HAS_BIAS=True, HAS_RESIDUAL=False, RESIDUAL_FIRST=False, ACTIVATION=2, QUANT=0, FAST_MATH=False, GATED=False,
                INPUT_PRECISION="ieee", DOT_IN_FP32=False, EVEN_K=True)
    args = gemm.kernel_args(kw, (x, w, b, o, o, o, o))
    grid = call.grid
    binder = gemm.linear_kernel.device_caches[torch.cuda.current_device()][-1]
    rows = {
        "gemm.linear_launch (checks, allocation, cached call)": lambda: gemm.linear_launch(x, w, b, None, "gelu"),
        "gemm.launch, explicit config (Triton's launch path)": lambda: gemm.launch(x, w, b, None, o, "gelu", config=cfg),
        "linear_kernel[grid](...)": lambda: gemm.linear_kernel[grid](*args, **meta, **kw),
        "  of which Triton's argument binder": lambda: binder(*args, **meta, **kw),
        "  of which torch.cuda.current_stream()": lambda: torch.cuda.current_stream().cuda_stream,
        "CompiledCall (the compiled kernel's launcher)": lambda: call(args, 0),
        "F.linear (for scale)": lambda: F.linear(x, w, b),
    }
    for name, fn in rows.items():
        print(f"{name:55s} {us(fn):7.2f} us")


if __name__ == "__main__":
    main()
