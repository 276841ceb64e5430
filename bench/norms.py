"""LayerNorm (and residual add + LayerNorm) on the GPU at real models' shapes: accelc::layer_norm
against eager PyTorch (F.layer_norm, after an add where fused) and torch.compile of the same
function (default mode: Inductor's own fused Triton kernel). With --rms: RMSNorm as HF's Llama
writes it (fp32 statistics, weight * normed.to(half)) against accelc::rms_norm.

    python bench/norms.py [--rms] [--out bench/results]

Timing as bench/gemm.py: CUDA-graph medians, ROUNDS interleaved rounds, speedups the median of
per-round ratios. A norm is memory-bound: each row reports the bytes it must move (x, the
residual, y; weights once) over the time, against the device's HBM bandwidth. Accuracy: relative
L2 error against fp64.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402,F401

# (rows, width, where): batch x tokens of real models
SHAPES = [(3072, 768, "BERT-base 8x384"), (4096, 768, "GPT-2 4x1024"), (6304, 768, "ViT-B/16 32x197"),
          (2048, 2048, "1B decoder 2x1024"), (4096, 4096, "7B decoder 4096 tokens"), (64, 768, "one short sequence")]
ROUNDS = 7



def rows_for(dtype=torch.float16) -> list[dict]:
    rows = []
    for M, N, where in SHAPES:
        for residual in (False, True):
            x = torch.randn(M, N, device="cuda", dtype=dtype) * 2 + 0.5
            r = torch.randn(M, N, device="cuda", dtype=dtype) if residual else None
            w = (torch.rand(N, device="cuda") + 0.5).to(dtype)
            b = torch.randn(N, device="cuda", dtype=dtype)

            def eager(x=x, r=r):
                return F.layer_norm(x if r is None else x + r, (N,), w, b, 1e-5)

            compiled = _common.compiled(eager)

            def accelc_ln(x=x, r=r):
                return torch.ops.accelc.layer_norm(x, w, b, r, 1e-5)

            ref = F.layer_norm((x if r is None else x + r).double(), (N,), w.double(), b.double(), 1e-5)
            row = {"shape": f"{M}x{N}", "where": where, "residual": residual, "dtype": str(dtype).replace("torch.", "")}
            rows.append(_common.measure_row(row, {"eager": eager, "compile": compiled, "accelc": accelc_ln}, ref, ROUNDS,
                                            moved=(M * N * (3 if residual else 2) + 2 * N) * x.element_size(),
                                            label=f"{row['shape']:>10} {'add+' if residual else '    '}LN"))
    return rows


RMS_SHAPES = [(2048, 2048, "TinyLlama-1.1B 2x1024"), (4096, 4096, "Llama-2-7B 4x1024"),
              (16, 4096, "Llama-2-7B decode, 16 sequences"), (2048, 768, "T5-base encoder 8x256")]


def rms_rows_for(dtype=torch.float16) -> list[dict]:
    rows = []
    for M, N, where in RMS_SHAPES:
        for residual in (False, True):
            x = torch.randn(M, N, device="cuda", dtype=dtype) * 2 + 0.5
            r = torch.randn(M, N, device="cuda", dtype=dtype) if residual else None
            w = (torch.rand(N, device="cuda") + 0.5).to(dtype)

            def eager(x=x, r=r):       # LlamaRMSNorm.forward, after the residual add where fused
                h = (x if r is None else x + r).to(torch.float32)
                h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
                return w * h.to(dtype)

            compiled = _common.compiled(eager)

            def accelc_rms(x=x, r=r):
                return torch.ops.accelc.rms_norm(x, w, r, 1e-6)

            h = (x if r is None else x + r).double()
            ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
            row = {"op": "add + RMSNorm" if residual else "RMSNorm", "shape": f"{M}x{N}", "where": where,
                   "residual": residual, "dtype": str(dtype).replace("torch.", "")}
            rows.append(_common.measure_row(row, {"eager": eager, "compile": compiled, "accelc": accelc_rms}, ref,
                                            ROUNDS, moved=(M * N * (3 if residual else 2) + N) * x.element_size(),
                                            label=f"{row['shape']:>10} {row['op']}"))
    return rows


def markdown(env, rows) -> str:
    table = []
    for r in rows:
        table.append([r["where"], r["shape"], r.get("op", "add + LN" if r["residual"] else "LN"), r["eager"]["us"],
                      r["compile"]["us"], r["accelc"]["us"], _common.gbs_cell(env, r['accelc']['gbs']),
                      f"{r['compile']['gbs']}", _common.ratio_cell(r["vs_eager"]),
                      _common.ratio_cell(r["vs_compile"]),
                      f"{r['rel_err']['accelc']:.1e} / {r['rel_err']['eager']:.1e}"])
    title = "RMSNorm (+ residual add), HF Llama's form" if rows and "RMS" in rows[0].get("op", "") else \
        "LayerNorm (+ residual add)"
    return (f"# {title}, fp16 ({env['device']})\n\n{_common.env_line(env)}\n\n"
            "us: CUDA-graph median per call, median of rounds; GB/s: bytes the op must move (x, residual, y, "
            "weights) over the time (% of the device's HBM bandwidth; a replay runs several calls on the same "
            "tensors, which smaller shapes read back from the 50 MB L2: near 100% means that); speedups: median (min-max) of per-round "
            "ratios; error: relative L2 vs fp64, accelc / eager.\n\n"
            + _common.md_table(["model", "rows x width", "op", "eager us", "torch.compile us", "accelc us",
                                "accelc GB/s", "compile GB/s", "accelc vs eager", "accelc vs compile",
                                "error accelc / eager"], table))


def main():
    _common.bench_main("norms", rows_for, markdown, {"rms": ("norms_rms", rms_rows_for)})


if __name__ == "__main__":
    main()
