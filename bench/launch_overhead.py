"""Host-side cost of one accelc::linear call, layer by layer of the call stack, against
F.linear: microseconds of CPU time per call on a tiny shape (GPU work negligible), no sync.

    python bench/launch_overhead.py
"""
import sys
import time

import torch
import torch.nn.functional as F

import accelc  # noqa: F401
from accelc.kernels import gemm


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main():
    x = torch.randn(16, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(256, device="cuda", dtype=torch.float16)
    out = torch.empty(16, 256, device="cuda", dtype=torch.float16)
    rows = {
        "F.linear": lambda: F.linear(x, w, b),
        "F.gelu(F.linear)": lambda: F.gelu(F.linear(x, w, b)),
        "torch.ops.accelc.linear": lambda: torch.ops.accelc.linear(x, w, b, activation="gelu"),
        "gemm.linear_launch": lambda: gemm.linear_launch(x, w, b, activation="gelu"),
        "gemm.launch, fixed config": lambda: gemm.launch(x, w, b, None, out, "gelu",
                                                         config=gemm.default_config(dict(M=16, dtype=x.dtype, tma=True))),
    }
    for name, fn in rows.items():
        print(f"{name:28s} {per_call_us(fn):7.1f} us/call (host)")


if __name__ == "__main__":
    main()


def profile():
    import cProfile
    import pstats

    x = torch.randn(16, 256, device="cuda", dtype=torch.float16)
    w = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    for _ in range(50):
        torch.ops.accelc.linear(x, w, None, activation="gelu")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(500):
        torch.ops.accelc.linear(x, w, None, activation="gelu")
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)


if __name__ == "__main__" and "--profile" in sys.argv:
    profile()
