"""Gated MLP input side (SwiGLU / GeGLU) on the GPU at real models' shapes: accelc::gated_linear
(both projections in one GEMM on the packed weight, act(a) * b in its epilogue) against eager PyTorch (two F.linear,
the activation, the product) and torch.compile of the same function (default mode: two cuBLAS
GEMMs and one fused Triton kernel for act * mul), with cuBLAS's single GEMM of the same FLOPs
(x @ [W_gate; W_up]^T, no epilogue) as the library's reference figure.

    python bench/gated.py [--out bench/results]

Timing as bench/gemm.py: CUDA-graph medians, ROUNDS interleaved rounds, speedups the median of
per-round ratios; TF/s over the two products' FLOPs (4 M N K); % of the device's dense fp16 peak.
Accuracy: relative L2 error against fp64. The tuned config (autotuned on first call) is used.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402,F401
from accelc.kernels.gated_linear import pack  # noqa: E402

# (tokens M, hidden K, intermediate N, where)
SHAPES = [(2048, 2048, 5632, "TinyLlama-1.1B 2x1024"), (4096, 4096, 11008, "Llama-2-7B 4x1024"),
          (4096, 4096, 14336, "Mistral-7B 4x1024"), (512, 4096, 11008, "Llama-2-7B 512 tokens"),
          (16, 4096, 11008, "Llama-2-7B decode, 16 sequences"), (2048, 768, 2048, "T5 v1.1-base GeGLU 8x256")]
ROUNDS = 5
PEAK_TFLOPS = {"H100 80GB HBM3": 989.0, "H200": 989.0}   # dense fp16 / bf16 tensor-core peak



def rows_for(dtype=torch.float16) -> list[dict]:
    rows = []
    for M, K, N, where in SHAPES:
        act = "gelu_tanh" if "GeGLU" in where else "silu"
        fn = (lambda t: F.gelu(t, approximate="tanh")) if act == "gelu_tanh" else F.silu
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        wg, wu = (torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5 for _ in range(2))
        w_cat = torch.cat([wg, wu])
        packed, _ = pack(wg, wu)

        def eager(x=x, wg=wg, wu=wu, fn=fn):
            return fn(F.linear(x, wg)) * F.linear(x, wu)

        compiled = _common.compiled(eager)

        def accelc_gated(x=x, w=packed, N=N, act=act):
            return torch.ops.accelc.gated_linear(x, w, None, N, act)

        def cublas_one_gemm(x=x, w=w_cat):
            return F.linear(x, w)

        xd = x.double()
        ref = (F.gelu(F.linear(xd, wg.double()), approximate="tanh") if act == "gelu_tanh"
               else F.silu(F.linear(xd, wg.double()))) * F.linear(xd, wu.double())
        row = {"shape": f"{M}x{K}x{N}", "where": where, "activation": act, "dtype": str(dtype).replace("torch.", "")}
        variants = {"eager": eager, "compile": compiled, "accelc": accelc_gated, "cublas_gemm": cublas_one_gemm}
        rows.append(_common.measure_row(row, variants, ref, ROUNDS, flops=4 * M * N * K, label=f"{row['shape']:>18} {act}"))
        row["vs_cublas_gemm"] = _common.speedup(row, "accelc", "cublas_gemm")
    return rows


def markdown(env, rows) -> str:
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in env["device"]), None)
    table = []
    for r in rows:
        pct = f" ({100 * r['accelc']['tflops'] / peak:.0f}%)" if peak else ""
        table.append([r["where"], r["shape"], r["activation"], r["eager"]["us"], r["compile"]["us"], r["accelc"]["us"],
                      r["cublas_gemm"]["us"], f"{r['accelc']['tflops']}{pct}", r["cublas_gemm"]["tflops"],
                      _common.ratio_cell(r["vs_eager"]),
                      _common.ratio_cell(r["vs_compile"]),
                      f"{r['rel_err']['accelc']:.1e} / {r['rel_err']['eager']:.1e}"])
    return (f"# Gated MLP input side (gate and up projections + act * mul), {rows[0]['dtype'] if rows else ''} "
            f"({env['device']})\n\n{_common.env_line(env)}\n\n"
            "us: CUDA-graph median per call, median of rounds; TF/s over 4 M N K (% of the dense fp16 peak); "
            "'cuBLAS one GEMM': x @ [W_gate; W_up]^T alone, the same FLOPs with no epilogue and one output twice as "
            "wide; speedups: median (min-max) of per-round ratios; error: relative L2 vs fp64, accelc / eager.\n\n"
            + _common.md_table(["model", "M x K x N", "act", "eager us", "torch.compile us", "accelc us",
                                "cuBLAS one GEMM us", "accelc TF/s", "cuBLAS TF/s", "accelc vs eager",
                                "accelc vs compile", "error accelc / eager"], table))


def main():
    _common.bench_main("gated", rows_for, markdown)


if __name__ == "__main__":
    main()
