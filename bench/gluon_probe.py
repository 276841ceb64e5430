"""One forced Gluon GEMM candidate on one shape, in its own process: prints PASS / FAIL / ERROR with the
relative error (a device fault in one case cannot poison the next). Used to bisect the Gluon kernel:

    python bench/gluon_probe.py CFG_INDEX M K N [--act gelu] [--res] [--no-bias] [--w-t] [--bf16]
"""
import argparse
import sys

import torch

import accelc  # noqa: F401
from accelc.kernels import gemm
from accelc.numerics import rel_l2

ap = argparse.ArgumentParser()
ap.add_argument("cfg", type=int)
ap.add_argument("M", type=int)
ap.add_argument("K", type=int)
ap.add_argument("N", type=int)
ap.add_argument("--act", default="none")
ap.add_argument("--res", action="store_true")
ap.add_argument("--no-bias", action="store_true")
ap.add_argument("--w-t", action="store_true")
ap.add_argument("--bf16", action="store_true")
a = ap.parse_args()
dt = torch.bfloat16 if a.bf16 else torch.float16
x = torch.randn(a.M, a.K, device="cuda", dtype=dt)
w = torch.randn(a.K, a.N, device="cuda", dtype=dt).t() if a.w_t else torch.randn(a.N, a.K, device="cuda", dtype=dt)
w = w / a.K ** 0.5
b = None if a.no_bias else torch.randn(a.N, device="cuda", dtype=dt)
r = torch.randn(a.M, a.N, device="cuda", dtype=dt) if a.res else None
cfg = gemm.GLUON_CONFIGS[a.cfg]
tag = f"cfg{a.cfg} {a.M}x{a.K}x{a.N} act={a.act} res={a.res} bias={not a.no_bias} w_t={a.w_t} {dt}"
try:
    with gemm.TUNER.force(cfg):
        out = gemm.linear_launch(x, w, b, r, a.act)
        torch.cuda.synchronize()
    ref = gemm.linear_ref(x.float(), w.float(), None if b is None else b.float(), None if r is None else r.float(), a.act)
    err = rel_l2(out.float(), ref)
    print(("PASS" if err < 2e-2 else "FAIL"), tag, f"rel_err {err:.2e}", flush=True)
except Exception as e:
    print("ERROR", tag, type(e).__name__, str(e).splitlines()[0][:200], flush=True)
    sys.exit(1)
