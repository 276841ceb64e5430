"""FP8 (e4m3) kernels on the GPU, each side in one run.

GEMM rows (fp8 weights and activations, fp16 in / out): accelc::linear_fp8 (the per-row activation quantization
included) and its GEMM alone (operands quantized beforehand) against cuBLAS's fp8 GEMM (torch._scaled_mm with the
same row-wise scales, alone and after accelc's row quantization), torch.compile(mode="max-autotune-no-cudagraphs")
of the same fp8 layer written in PyTorch (as torchao's float8 dynamic-activation layer computes it), and the fp16
layer (cuBLAS and accelc::linear). Shapes: 8192 x 8192 x 16384 and the e2e models' projections.

Decode rows (weight-only fp8, batch 1 and 16): accelc::linear_fp8w against fp16 (cuBLAS, accelc::linear) and
weight-only int8 (accelc::linear_w8a16); GB/s of the weight's bytes.

Norm rows (--norm SHAPES): the RMSNorm before a decode projection, per weight (fp16, int8, fp8): the op alone, the
op with the norm taken in (norm_weight / norm_eps: the norm_linear pass's form) and the norm apart
(accelc::rms_norm, then the op): what taking the norm in costs or saves at each weight.

    python bench/fp8.py [--out bench/results] [--no-compile] [--quick] [--norm MxKxN,...]

Timing as bench/int8.py: CUDA-graph medians, ROUNDS interleaved rounds with an idle pause before each, speedups
the median of per-round ratios. Accuracy: SQNR (dB) of each output against the fp32 layer on the float weight.
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
from accelc.kernels import fp8_gemm, fp8_weight, gemm  # noqa: E402
from accelc.kernels.int8_gemm import quantize_weight as quantize_weight_int8  # noqa: E402

# (M, K, N): the headline square-ish GEMM; ViT-B/16 at batch 32 (qkv, MLP up); BERT-base 8 x 512 (MLP up,
# down); the Llama-3-8B prefill shape at 2 x 1024 (gate/up half, down)
GEMM_SHAPES = [(8192, 8192, 16384), (6304, 768, 2304), (6304, 768, 3072), (4096, 768, 3072), (4096, 3072, 768),
               (2048, 4096, 14336), (2048, 14336, 4096)]
DECODE_SHAPES = [(1, 4096, 14336), (1, 14336, 4096), (1, 4096, 4096), (16, 4096, 14336), (16, 14336, 4096)]
ROUNDS = 7
SETTLE_S = 0.5


def sqnr(out, ref) -> float:
    err = (out.float() - ref.float()).norm() / ref.float().norm()
    return round(-20 * math.log10(max(err.item(), 1e-12)), 1)


def fp8_layer_torch(x, w_q, w_s):
    """The fp8 layer in PyTorch: each row scaled to e4m3's 448, cuBLAS's fp8 GEMM with row-wise scales."""
    a_s = x.abs().amax(-1, keepdim=True).float().clamp_min(1e-12) / 448.0
    q = (x.float() / a_s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return torch._scaled_mm(q, w_q.t(), scale_a=a_s, scale_b=w_s[None, :], out_dtype=x.dtype,
                           use_fast_accum=True)


def _timed(row: dict, variants: dict, ref: torch.Tensor, flops: float, moved: float | None = None) -> None:
    for name in list(variants):
        try:
            out = variants[name]()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 (cuBLAS's fp8 GEMM takes M in multiples of 16: recorded, not run)
            row.setdefault("skipped", {})[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            del variants[name]
            continue
        ok = isinstance(out, torch.Tensor) and out.shape == ref.shape   # (the quantizer alone: no layer output)
        row[name] = {"sqnr_db": sqnr(out, ref)} if ok else {}
    _common.time_rounds(variants, row, ROUNDS, flops, rep_ms=50, settle_s=SETTLE_S)
    if moved is not None:
        for name in variants:
            row[name]["gbs"] = round(moved / row[name]["us"] / 1e3, 1)


def gemm_rows(compile_too: bool, shapes) -> list[dict]:
    rows = []
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        w = (torch.randn(N, K, device="cuda") / K**0.5).half()
        w_q, w_s = fp8_weight.quantize_weight(w)
        q, a_s = fp8_gemm.quantize_rows(x)
        out = torch.empty(M, N, device="cuda", dtype=torch.float16)

        def gemm_only():
            gemm.launch(q, w_q, None, None, out, scales=(a_s, w_s), tuner=fp8_gemm.TUNER)
            return out

        variants = {
            "cublas_fp16": lambda: F.linear(x, w),
            "accelc_fp16": lambda: torch.ops.accelc.linear(x, w, None),
            "accelc_fp8": lambda: torch.ops.accelc.linear_fp8(x, w_q, w_s),
            "accelc_fp8_gemm_only": gemm_only,
            "accelc_quantize_only": lambda: fp8_gemm.quantize_rows(x),
            "scaled_mm_only": lambda: torch._scaled_mm(q, w_q.t(), scale_a=a_s[:, None], scale_b=w_s[None, :],
                                                       out_dtype=torch.float16, use_fast_accum=True),
            "accelc_quantize_scaled_mm": lambda: torch._scaled_mm(*_q_then(x, w_q), scale_b=w_s[None, :],
                                                                  out_dtype=torch.float16, use_fast_accum=True),
        }
        if compile_too:
            variants["compile_fp8"] = _common.compiled(lambda: fp8_layer_torch(x, w_q, w_s),
                                                      mode="max-autotune-no-cudagraphs")
        ref = F.linear(x.float(), w.float())
        row = {"M": M, "K": K, "N": N}
        _timed(row, variants, ref, 2 * M * N * K)
        for base in ("cublas_fp16", "accelc_fp16", "scaled_mm_only", "accelc_quantize_scaled_mm", "compile_fp8"):
            if base in variants:
                row[f"fp8_vs_{base}"] = _common.speedup(row, "accelc_fp8", base)
        if "scaled_mm_only" in variants:
            row["gemm_only_vs_scaled_mm_only"] = _common.speedup(row, "accelc_fp8_gemm_only", "scaled_mm_only")
        cfg, row["spread"] = _common.tuned(fp8_gemm.TUNER, lambda k: k[:3] == (triton.next_power_of_2(M), N, K))
        row["fp8_config"] = str(cfg) if cfg else "n/a"
        print(f"  {M}x{K}x{N}: " + ", ".join(f"{n} {row[n]['us']:.1f} us ({row[n]['tflops']:.0f} TF/s, "
                                              f"{row[n].get('sqnr_db', '-')} dB)" for n in variants), flush=True)
        rows.append(row)
    return rows


def _q_then(x, w_q):
    q, a_s = fp8_gemm.quantize_rows(x)
    return q, w_q.t(), a_s[:, None]


def decode_rows(shapes) -> list[dict]:
    rows = []
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        w = (torch.randn(N, K, device="cuda") / K**0.5).half()
        w_q, w_s = fp8_weight.quantize_weight(w)
        w_i8, w_s8 = quantize_weight_int8(w)
        variants = {
            "cublas_fp16": lambda: F.linear(x, w),
            "accelc_fp16": lambda: torch.ops.accelc.linear(x, w, None),
            "accelc_int8w": lambda: torch.ops.accelc.linear_w8a16(x, w_i8, w_s8),
            "accelc_fp8w": lambda: torch.ops.accelc.linear_fp8w(x, w_q, w_s),
        }
        ref = F.linear(x.float(), w.float())
        row = {"M": M, "K": K, "N": N}
        _timed(row, variants, ref, 2 * M * N * K)
        for name in variants:   # the weight's bytes (the activations' are negligible at these rows)
            row[name]["weight_gbs"] = round(N * K * (2 if "fp16" in name else 1) / row[name]["us"] / 1e3, 1)
        for base in ("cublas_fp16", "accelc_fp16", "accelc_int8w"):
            row[f"fp8w_vs_{base}"] = _common.speedup(row, "accelc_fp8w", base)
        print(f"  decode {M}x{K}x{N}: " + ", ".join(f"{n} {row[n]['us']:.1f} us ({row[n]['weight_gbs']} GB/s, "
                                                     f"{row[n].get('sqnr_db', '-')} dB)" for n in variants), flush=True)
        rows.append(row)
    return rows


NORM_EPS = 1e-5


def norm_rows(shapes) -> list[dict]:
    rows = []
    for M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        g = (1 + 0.1 * torch.randn(K, device="cuda")).half()
        w = (torch.randn(N, K, device="cuda") / K**0.5).half()
        w_q, w_s = fp8_weight.quantize_weight(w)
        w_i8, w_s8 = quantize_weight_int8(w)
        ops = {"fp16": lambda a, **kw: torch.ops.accelc.linear(a, w, None, **kw),
               "int8w": lambda a, **kw: torch.ops.accelc.linear_w8a16(a, w_i8, w_s8, **kw),
               "fp8w": lambda a, **kw: torch.ops.accelc.linear_fp8w(a, w_q, w_s, **kw)}
        variants = {}
        for kind, op in ops.items():
            variants[f"{kind}_alone"] = lambda op=op: op(x)
            variants[f"{kind}_norm_in"] = lambda op=op: op(x, norm_weight=g, norm_eps=NORM_EPS)
            variants[f"{kind}_norm_apart"] = lambda op=op: op(torch.ops.accelc.rms_norm(x, g, None, NORM_EPS))
        xf = x.float()
        ref = F.linear(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + NORM_EPS) * g.float(), w.float())
        row = {"M": M, "K": K, "N": N}
        _timed(row, variants, ref, 2 * M * N * K)
        for kind in ops:
            row[f"{kind}_in_vs_apart"] = _common.speedup(row, f"{kind}_norm_in", f"{kind}_norm_apart")
        print(f"  norm {M}x{K}x{N}: " + ", ".join(f"{n} {row[n]['us']:.1f} us" for n in variants), flush=True)
        rows.append(row)
    return rows


def markdown(env: dict, data: dict) -> str:
    def t(r, k):
        return f"{r[k]['us']:.1f}" if "us" in r.get(k, {}) else "n/a"

    def rate(r, k, kind):
        return _common.rate_cell(env, r[k]["tflops"], kind) if "us" in r.get(k, {}) else "n/a"

    def sp(r, k):
        return _common.ratio_cell(tuple(r[k])) if k in r else "n/a"

    header = ["M x K x N", "cuBLAS fp16 us", "accelc fp16 us", "accelc fp8 us (GEMM / quantize)",
              "_scaled_mm us (after accelc's quantize)", "compile fp8 us", "accelc fp8 rate", "fp8 GEMM alone rate",
              "accelc fp8 / cuBLAS fp16", "accelc fp8 / accelc fp16", "fp8 GEMM alone / _scaled_mm alone",
              "accelc fp8 / compile fp8", "SQNR dB fp8 (fp16)"]
    table = [[f"{r['M']} x {r['K']} x {r['N']}", t(r, "cublas_fp16"), t(r, "accelc_fp16"),
              f"{t(r, 'accelc_fp8')} ({t(r, 'accelc_fp8_gemm_only')} / {t(r, 'accelc_quantize_only')})",
              f"{t(r, 'scaled_mm_only')} ({t(r, 'accelc_quantize_scaled_mm')})", t(r, "compile_fp8"),
              rate(r, "accelc_fp8", "fp8"), rate(r, "accelc_fp8_gemm_only", "fp8"),
              sp(r, "fp8_vs_cublas_fp16"), sp(r, "fp8_vs_accelc_fp16"), sp(r, "gemm_only_vs_scaled_mm_only"),
              sp(r, "fp8_vs_compile_fp8"),
              f"{r['accelc_fp8']['sqnr_db']} ({r['accelc_fp16']['sqnr_db']})"] for r in data["gemm"]]
    dec_header = ["M x K x N", "cuBLAS fp16 us", "accelc fp16 us", "accelc int8w us", "accelc fp8w us",
                  "fp8w weight GB/s", "fp8w / accelc fp16", "fp8w / cuBLAS fp16", "fp8w / int8w",
                  "SQNR dB fp8w (int8w)"]
    dec = [[f"{r['M']} x {r['K']} x {r['N']}", t(r, "cublas_fp16"), t(r, "accelc_fp16"), t(r, "accelc_int8w"),
            t(r, "accelc_fp8w"), _common.gbs_cell(env, r["accelc_fp8w"]["weight_gbs"]),
            sp(r, "fp8w_vs_accelc_fp16"), sp(r, "fp8w_vs_cublas_fp16"), sp(r, "fp8w_vs_accelc_int8w"),
            f"{r['accelc_fp8w']['sqnr_db']} ({r['accelc_int8w']['sqnr_db']})"] for r in data["decode"]]
    skipped = "; ".join(f"{r['M']}x{r['K']}x{r['N']} {k}: {v}" for part in ("gemm", "decode")
                        for r in data[part] for k, v in r.get("skipped", {}).items())
    configs = "; ".join(f"{r['M']}x{r['K']}x{r['N']}: {r['fp8_config']} (spread {_common.spread_cell(r['spread'])})"
                        for r in data["gemm"])
    return (f"# FP8 (e4m3) kernels\n\n{_common.env_line(env)}\n\n"
            f"Times: median over a captured CUDA graph, median of {ROUNDS} interleaved rounds, each after "
            f"{SETTLE_S} s idle; ratios = the other's time / accelc's, median of per-round ratios (range). "
            "accelc fp8 includes the per-row activation quantization (dynamic scales); the weight was quantized "
            "beforehand, one scale per output channel. `_scaled_mm`: cuBLAS's fp8 GEMM with the same row-wise "
            "scales. compile fp8: torch.compile(max-autotune-no-cudagraphs) of the whole fp8 layer in PyTorch "
            "(quantize + _scaled_mm). cuBLAS's fp8 GEMM runs with use_fast_accum=True (its faster form, as torchao's "
            "float8 forward uses it; Triton's fp8 dot on Hopper accumulates the same way). Rates: TF/s of 2*M*N*K with the share of the dense fp8 peak. SQNR against "
            "the fp32 layer on the float weight.\n\n## Weights and activations in fp8\n\n"
            + _common.md_table(header, table)
            + f"\nfp8 configs chosen: {configs}\n\n## Weight-only fp8, decode rows\n\n"
            + _common.md_table(dec_header, dec)
            + (f"\nnot run: {skipped}\n" if skipped else "")
            + (norm_markdown(data["norm"]) if data.get("norm") else ""))


def norm_markdown(rows) -> str:
    def t(r, k):
        return f"{r[k]['us']:.1f}" if "us" in r.get(k, {}) else "n/a"

    header = ["M x K x N"] + [f"{kind} us: alone / norm in / apart (in vs apart)" for kind in ("fp16", "int8w", "fp8w")]
    table = [[f"{r['M']} x {r['K']} x {r['N']}"] + [
        f"{t(r, kind + '_alone')} / {t(r, kind + '_norm_in')} / {t(r, kind + '_norm_apart')} "
        f"({_common.ratio_cell(tuple(r[kind + '_in_vs_apart'])) if kind + '_in_vs_apart' in r else 'n/a'})"
        for kind in ("fp16", "int8w", "fp8w")] for r in rows]
    return ("\n## The RMSNorm before a decode projection\n\nEach weight's op alone, with the norm taken in "
            "(norm_weight), and after accelc::rms_norm; in vs apart: apart's time / in's.\n\n" + _common.md_table(header, table))


def _shapes(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(n) for n in part.split("x")) for part in text.split(",") if part]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--quick", action="store_true", help="the first GEMM shape and two decode shapes only")
    ap.add_argument("--gemm", metavar="MxKxN,...", default=None, help="these GEMM shapes instead ('' for none)")
    ap.add_argument("--decode", metavar="MxKxN,...", default=None, help="these decode shapes instead ('' for none)")
    ap.add_argument("--norm", metavar="MxKxN,...", default="", help="norm rows at these shapes (none by default)")
    args = ap.parse_args()
    env = _common.environment()
    print(_common.env_line(env))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("bench/fp8.py needs a GPU with fp8 tensor cores (sm89 or later)")
    data = {"gemm": [], "decode": [], "norm": []}
    gemm_shapes = _shapes(args.gemm) if args.gemm is not None else GEMM_SHAPES[:2] if args.quick else GEMM_SHAPES
    decode_shapes = (_shapes(args.decode) if args.decode is not None else DECODE_SHAPES[:2] if args.quick
                     else DECODE_SHAPES)
    # the decode rows first (short), every row written as it lands: a run cut by a time limit keeps its rows
    for part, shapes, rows_for in (("norm", _shapes(args.norm), norm_rows), ("decode", decode_shapes, decode_rows),
                                   ("gemm", gemm_shapes, lambda sh: gemm_rows(not args.no_compile, sh))):
        for shape in shapes:
            data[part] += rows_for([shape])
            md = markdown(env, data)
            _common.write(args.out, "fp8", env, data, md)
    print()
    print(md)


if __name__ == "__main__":
    main()
