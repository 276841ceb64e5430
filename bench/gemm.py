"""Fused linear + bias + GELU, fp16, on the GPU: accelc::linear against cuBLAS + eager GELU,
cuBLAS alone, and torch.compile(mode="max-autotune-no-cudagraphs") of the same eager code.

    python bench/gemm.py [--out bench/results] [--no-compile]

Every variant is timed with accelc.latency.median_ms over a captured CUDA graph (kernel time,
no Python launch overhead), in ROUNDS interleaved rounds: the H100 here drifts by 5-8% over a
minute of sustained GEMMs, so each round times every variant back to back and the speedups are
medians of per-round ratios. Plain calls (Python launch overhead included) are timed once.
Rates with their share of the device's dense fp16 peak; accelc tunes every shape here (a fresh
cache directory) and the row gives the spread of its candidates' tuning times.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

_common.fresh_tuning_cache()   # tune every shape here
import accelc  # noqa: E402,F401
from accelc.kernels import gemm  # noqa: E402
from accelc.latency import median_ms  # noqa: E402

SHAPES = [(4096, 4096, 16384), (512, 4096, 4096), (16, 4096, 4096)]  # (M, K, N)
ROUNDS = 7


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile max-autotune")
    args = ap.parse_args()
    env = _common.environment()
    print(_common.env_line(env))
    dev = "cuda"

    a = torch.randn(4096, 4096, device=dev, dtype=torch.float16)
    ceiling = 2 * 4096**3 / median_ms(lambda: a @ a, cuda_graph=True) / 1e9
    print(f"cuBLAS fp16 4096^3 matmul: {ceiling:.0f} TF/s")

    rows = []
    for M, K, N in SHAPES:
        x = torch.randn(M, K, device=dev, dtype=torch.float16)
        w = (torch.randn(N, K, device=dev) / K**0.5).half()
        b = torch.randn(N, device=dev, dtype=torch.float16)

        def eager():
            return F.gelu(F.linear(x, w, b))

        def cublas():
            return F.linear(x, w, b)

        def fused():
            return torch.ops.accelc.linear(x, w, b, activation="gelu")

        variants = {"eager": eager, "cublas_linear_only": cublas, "accelc": fused}
        if not args.no_compile:
            compiled = _common.compiled(eager, mode="max-autotune-no-cudagraphs")
            variants["compile"] = compiled
        ref = gemm.linear_ref(x.float(), w.float(), b.float(), activation="gelu")
        flops = 2 * M * N * K
        row = {"M": M, "K": K, "N": N}
        for name, fn in variants.items():  # compile, autotune, check
            out = fn()
            torch.cuda.synchronize()
            row[name] = {"rel_l2_vs_fp32": float(f"{_common.rel_l2(out, ref):.3e}"),
                         "us_plain_calls": round(median_ms(fn) * 1e3, 2)}
        _common.time_rounds(variants, row, ROUNDS, flops, rep_ms=50)
        for name in variants:
            print(f"  {M}x{K}x{N} {name:20s} {row[name]['us']:9.1f} us  {row[name]['tflops']:6.1f} TF/s"
                  f"  (plain calls {row[name]['us_plain_calls']:8.1f} us)  err {row[name]['rel_l2_vs_fp32']:.1e}")
        for base in ("eager", "compile"):
            if base in row:
                med, lo, hi = _common.speedup(row, "accelc", base)
                row[f"speedup_vs_{base}"], row[f"speedup_vs_{base}_range"] = med, [lo, hi]
        cfg, row["spread"] = _common.tuned(gemm.TUNER, lambda k: k[:3] == (triton.next_power_of_2(M), N, K))
        row["accelc_config"] = str(cfg) if cfg else "n/a"
        rows.append(row)

    header = ["M x K x N", "eager cuBLAS+GELU", "cuBLAS linear only", "torch.compile max-autotune",
              "accelc fused", "accelc / eager", "accelc / compile", "autotune spread"]
    table = []
    for r in rows:
        def cell(k):
            return f"{r[k]['us']:.1f} us, {_common.rate_cell(env, r[k]['tflops'])}" if k in r else "n/a"
        sp_e = f"{r['speedup_vs_eager']:.2f}x ({r['speedup_vs_eager_range'][0]:.2f}-{r['speedup_vs_eager_range'][1]:.2f})"
        sp_c = (f"{r['speedup_vs_compile']:.2f}x ({r['speedup_vs_compile_range'][0]:.2f}-"
                f"{r['speedup_vs_compile_range'][1]:.2f})" if "compile" in r else "n/a")
        table.append([f"{r['M']} x {r['K']} x {r['N']}", cell("eager"), cell("cublas_linear_only"),
                      cell("compile"), cell("accelc"), sp_e, sp_c, _common.spread_cell(r.get("spread"))])
    md = (f"# accelc::linear (fused bias + GELU), fp16\n\n{_common.env_line(env)}\n\n"
          f"cuBLAS fp16 4096^3 matmul on this device: {ceiling:.0f} TF/s. Times: median over a "
          f"captured CUDA graph (L2 flushed between replays), median of {ROUNDS} interleaved rounds; "
          "speedup = eager (or compile) time / accelc time, median of per-round ratios (range in "
          "brackets); > 1 means accelc is faster. Rates: TF/s with the % of the dense fp16 peak; spread: "
          "fastest - slowest candidate as the tuner timed them.\n\n"
          + _common.md_table(header, table)
          + "\nautotuned accelc configs: " + "; ".join(f"{r['M']}: {r['accelc_config']}" for r in rows)
          + "\n\nPlain calls (Python launch overhead included, not graph-captured), us: "
          + "; ".join(f"{r['M']}: eager {r['eager']['us_plain_calls']}, accelc {r['accelc']['us_plain_calls']}"
                      for r in rows) + "\n")
    _common.write(args.out, "gemm", env, rows, md)
    print()
    print(md)


if __name__ == "__main__":
    main()
