"""W8A8 linear + bias + GELU on the GPU: accelc::linear_w8a8 (per-token activation quantization
included) against fp16 eager (cuBLAS + GELU), accelc's fp16 kernel, torch._int_mm alone, and
torch.compile(mode="max-autotune-no-cudagraphs") of the same W8A8 math written in PyTorch.
Also accelc's flash attention with q @ k^T in int8 against its fp16 form.

    python bench/int8.py [--out bench/results] [--no-compile]

Timing as bench/gemm.py: CUDA-graph medians, ROUNDS interleaved rounds, speedups the median of
per-round ratios. Accuracy: SQNR (dB) of each output against the fp32 float layer.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

_common.fresh_tuning_cache()   # tune every shape here
import accelc  # noqa: E402,F401
from accelc.kernels import int8_gemm  # noqa: E402
from accelc.kernels.int8_gemm import int8_gemm_launch, quantize_weight  # noqa: E402
from accelc.kernels.quantize import quantize_launch  # noqa: E402
from accelc.latency import median_ms  # noqa: E402

SHAPES = [(4096, 4096, 16384), (512, 4096, 4096), (16, 4096, 4096)]  # (M, K, N)
ATTN_SHAPES = [(4, 16, 4096, 128), (32, 12, 197, 64)]                   # (B, H, L, D)
ROUNDS = 7
SETTLE_S = 0.5   # idle before each timing: every side starts from the same clocks (_common.time_rounds)


def sqnr(out, ref) -> float:
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    return round(-20 * math.log10(err.item()), 1)


def linear_rows(compile_too: bool) -> list[dict]:
    dev = "cuda"
    rows = []
    for M, K, N in SHAPES:
        x = torch.randn(M, K, device=dev, dtype=torch.float16)
        w = (torch.randn(N, K, device=dev) / K**0.5).half()
        b = torch.randn(N, device=dev, dtype=torch.float16)
        w_q, w_s = quantize_weight(w)
        w_qt = w_q.t()
        q, a_s = quantize_launch(x)

        def eager():
            return F.gelu(F.linear(x, w, b))

        def accelc_fp16():
            return torch.ops.accelc.linear(x, w, b, activation="gelu")

        def accelc_w8a8():
            return torch.ops.accelc.linear_w8a8(x, w_q, w_s, b, activation="gelu")

        def int8_gemm_only():   # activations already quantized: the GEMM + dequant epilogue
            return int8_gemm_launch(q, a_s, w_q, w_s, b, activation="gelu")

        def quantize_only():
            return quantize_launch(x)

        def int_mm():
            return torch._int_mm(q, w_qt)

        def w8a8_torch():
            s = x.abs().amax(-1, keepdim=True).float() / 127
            xq = torch.round(x.float() / s).clamp(-127, 127).to(torch.int8)
            acc = torch._int_mm(xq, w_qt)
            return F.gelu(acc.float() * s * w_s + b.float()).half()

        variants = {"eager_fp16": eager, "accelc_fp16": accelc_fp16, "accelc_w8a8": accelc_w8a8,
                    "accelc_int8_gemm_only": int8_gemm_only, "accelc_quantize_only": quantize_only,
                    "torch_int_mm_only": int_mm}
        if compile_too:
            variants["compile_w8a8"] = _common.compiled(w8a8_torch, mode="max-autotune-no-cudagraphs")
        ref = F.gelu(F.linear(x.float(), w.float(), b.float()))
        row = {"M": M, "K": K, "N": N, "skipped": {}}
        for name in list(variants):
            try:
                out = variants[name]()
                torch.cuda.synchronize()
            except Exception as e:  # torch._int_mm needs M > 16; record why and go on
                row["skipped"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                del variants[name]
                continue
            if isinstance(out, torch.Tensor) and out.is_floating_point() and out.shape == ref.shape:
                row[name] = {"sqnr_db": sqnr(out, ref)}
            else:
                row[name] = {}
            row[name]["us_plain_calls"] = round(median_ms(variants[name]) * 1e3, 2)
        _common.time_rounds(variants, row, ROUNDS, 2 * M * N * K, rep_ms=50, settle_s=SETTLE_S)
        for name in variants:
            print(f"  {M}x{K}x{N} {name:24s} {row[name]['us']:9.1f} us  {row[name]['tflops']:7.1f} T(F)OPS"
                  f"  sqnr {row[name].get('sqnr_db', '')}")
        for base in ("eager_fp16", "accelc_fp16", "compile_w8a8"):
            if base in row and base in variants:
                med, lo, hi = _common.speedup(row, "accelc_w8a8", base)
                row[f"w8a8_speedup_vs_{base}"], row[f"w8a8_speedup_vs_{base}_range"] = med, [lo, hi]
        cfg, row["spread"] = _common.tuned(int8_gemm.TUNER, lambda k: k[:3] == (triton.next_power_of_2(M), N, K))
        row["int8_config"] = str(cfg) if cfg else "n/a"
        rows.append(row)
    return rows


def attention_rows() -> list[dict]:
    rows = []
    for B, H, L, D in ATTN_SHAPES:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3))
        variants = {
            "flash_fp16": lambda: torch.ops.accelc.flash_attention(q, k, v),
            "flash_qk_int8": lambda: torch.ops.accelc.flash_attention(q, k, v, qk_int8=True),
        }
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        row = {"B": B, "H": H, "L": L, "D": D}
        for name, fn in variants.items():
            row[name] = {"sqnr_db": sqnr(fn(), ref)}
        _common.time_rounds(variants, row, ROUNDS, 4 * B * H * L * L * D, rep_ms=50, settle_s=SETTLE_S)
        row["speedup"] = _common.speedup(row, "flash_qk_int8", "flash_fp16")
        rows.append(row)
        print(f"  attention {B}x{H}x{L}x{D}: fp16 {row['flash_fp16']['us']:.1f} us, qk int8 "
              f"{row['flash_qk_int8']['us']:.1f} us ({row['speedup'][0]:.2f}x), sqnr "
              f"{row['flash_fp16']['sqnr_db']} / {row['flash_qk_int8']['sqnr_db']} dB")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    env = _common.environment()
    print(_common.env_line(env))
    rows = linear_rows(not args.no_compile)
    attn = attention_rows()

    def t(r, k):
        return f"{r[k]['us']:.1f}" if k in r and "us" in r[k] else "n/a"

    def sp(r, base):
        k = f"w8a8_speedup_vs_{base}"
        return f"{r[k]:.2f}x ({r[k + '_range'][0]:.2f}-{r[k + '_range'][1]:.2f})" if k in r else "n/a"

    def rate(r, k, kind):
        return _common.rate_cell(env, r[k]["tflops"], kind) if "us" in r.get(k, {}) else "n/a"

    header = ["M x K x N", "fp16 eager us", "accelc fp16 us", "compile W8A8 us", "accelc W8A8 us",
              "(int8 GEMM / quantize) us", "torch._int_mm us (TOPS)", "W8A8 / fp16 eager", "W8A8 / compile",
              "SQNR dB W8A8 (fp16)", "fp16 eager rate", "accelc W8A8 rate", "int8 GEMM alone rate",
              "int8 autotune spread"]
    table = [[f"{r['M']} x {r['K']} x {r['N']}", t(r, "eager_fp16"), t(r, "accelc_fp16"), t(r, "compile_w8a8"),
              t(r, "accelc_w8a8"), f"{t(r, 'accelc_int8_gemm_only')} / {t(r, 'accelc_quantize_only')}",
              (f"{t(r, 'torch_int_mm_only')} ({r['torch_int_mm_only']['tflops']:.0f})"
               if "us" in r.get("torch_int_mm_only", {}) else "n/a"),
              sp(r, "eager_fp16"), sp(r, "compile_w8a8"),
              f"{r['accelc_w8a8']['sqnr_db']} ({r['eager_fp16']['sqnr_db']})",
              rate(r, "eager_fp16", "fp16"), rate(r, "accelc_w8a8", "int8"), rate(r, "accelc_int8_gemm_only", "int8"),
              _common.spread_cell(r.get("spread"))] for r in rows]
    attn_table = [[f"{r['B']}x{r['H']}x{r['L']}x{r['D']}", f"{r['flash_fp16']['us']:.1f}",
                   f"{r['flash_qk_int8']['us']:.1f}", f"{r['speedup'][0]:.2f}x",
                   f"{r['flash_fp16']['sqnr_db']} / {r['flash_qk_int8']['sqnr_db']}"] for r in attn]
    skipped = "; ".join(f"{r['M']}: {k}: {v}" for r in rows for k, v in r["skipped"].items())
    md = (f"# W8A8 linear + bias + GELU, fp16 in / out\n\n{_common.env_line(env)}\n\n"
          "Times: median over a captured CUDA graph (L2 flushed between replays), median of "
          f"{ROUNDS} interleaved rounds, each timing after {SETTLE_S} s idle (so that no side starts in the "
          "lowered clocks the one before left); speedup = the other's time / accelc W8A8's, median of per-round "
          "ratios (range). accelc W8A8 includes the per-token activation quantization kernel; the "
          "weight was quantized beforehand (once, at optimize time). SQNR against the fp32 float layer. "
          "Rates: TF/s (fp16) or TOPS (int8, the W8A8 layer's 2*M*N*K over its whole time, quantization "
          "included) with the share of the device's dense fp16 / int8 peak; spread: fastest - slowest int8 "
          "GEMM candidate as the tuner timed them.\n\n"
          + _common.md_table(header, table)
          + "\nautotuned int8 configs: " + "; ".join(f"{r['M']}: {r['int8_config']}" for r in rows)
          + (f"\n\nnot run: {skipped}" if skipped else "")
          + "\n\n## Flash attention, q @ k^T in int8 (fp16 softmax and p @ v)\n\n"
          + _common.md_table(["B x H x L x D", "fp16 us", "qk int8 us", "int8 / fp16", "SQNR dB fp16 / int8"],
                             attn_table))
    _common.write(args.out, "int8", env, {"linear": rows, "attention": attn}, md)
    print()
    print(md)


if __name__ == "__main__":
    main()
