"""One forced call of every Gluon candidate (GEMM or attention) in its own process, so that a kernel
that faults or hangs is named and cannot poison the next: the first device step after a change to
kernels/attention_hopper.py or kernels/gemm_hopper.py, before the tests and benches.

    python bench/gluon_smoke.py [--kernel attention|gemm] [--timeout 120]
"""
from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = r'''
import sys, torch
from accelc.kernels import flash_attention as fa, gemm
from accelc.numerics import rel_l2
i = int(sys.argv[1])
if sys.argv[2] == "attention":
    cfg = fa.GLUON_CONFIGS[i]
    D = 128 if cfg.kwargs.get("CONSUMERS", 2) == 2 else 64
    q, k, v = (torch.randn(2, 300, 4, D, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
    with fa.TUNER.force(cfg):
        out = fa.flash_attention(q, k, v)
    ref = fa.flash_attention_ref(q.float(), k.float(), v.float())
else:
    cfg = gemm.GLUON_CONFIGS[i]
    x = torch.randn(1000, 768, device="cuda", dtype=torch.float16)
    w = torch.randn(2304, 768, device="cuda", dtype=torch.float16) / 28
    with gemm.TUNER.force(cfg):
        out = gemm.linear_launch(x, w)
    ref = x.float() @ w.float().t()
torch.cuda.synchronize()
print(f"config {i} {cfg.kwargs}: rel_l2 {rel_l2(out.float(), ref):.2e}")
'''


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("attention", "gemm"), default="attention")
    ap.add_argument("--timeout", type=int, default=120)
    args = ap.parse_args()
    from accelc.kernels import flash_attention, gemm
    n = len((flash_attention if args.kernel == "attention" else gemm).GLUON_CONFIGS)
    bad = 0
    for i in range(n):
        try:
            done = subprocess.run([sys.executable, "-c", CHILD, str(i), args.kernel], capture_output=True, text=True,
                                  timeout=args.timeout)
            text = done.stdout.strip() or done.stderr.strip()[-800:]
            bad += done.returncode != 0
            print(f"[{i}] rc={done.returncode} {text}", flush=True)
        except subprocess.TimeoutExpired:
            bad += 1
            print(f"[{i}] TIMEOUT after {args.timeout} s (a hang: a barrier never completed?)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
