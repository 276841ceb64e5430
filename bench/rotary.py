"""Rotary position embedding on the GPU at real decoders' shapes: accelc::rotary_embedding (one
kernel per tensor) against eager PyTorch (HF's apply_rotary_pos_emb for q and k: slices, neg, cat,
two muls and an add each) and torch.compile of the same function (Inductor's fused kernels).

    python bench/rotary.py [--out bench/results]

q and k are the transposed views of the projections' (B, L, H, D) outputs, as HF's attention makes
them; cos / sin (B, 1, L, D) in the model's dtype. Timing as bench/gemm.py: CUDA-graph medians,
ROUNDS interleaved rounds, speedups the median of per-round ratios. RoPE is memory-bound: each row
reports the bytes it must move (q and k read and written, cos and sin read once) over the time.
Accuracy: relative L2 error of (q, k) against fp64.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402,F401

# (batch, tokens, query heads, key/value heads, head dim, where)
SHAPES = [(2, 1024, 32, 4, 64, "TinyLlama-1.1B 2x1024"), (4, 1024, 32, 32, 128, "Llama-2-7B 4x1024"),
          (1, 4096, 32, 8, 128, "Mistral-7B 4096 tokens"), (16, 1, 32, 8, 128, "Mistral-7B decode, 16 sequences"),
          (8, 512, 16, 16, 128, "Qwen-style 8x512")]
ROUNDS = 7


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rows_for(dtype=torch.float16) -> list[dict]:
    rows = []
    for B, L, H, Hkv, D, where in SHAPES:
        q = torch.randn(B, L, H, D, device="cuda", dtype=dtype).transpose(1, 2)
        k = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype).transpose(1, 2)
        pos = torch.arange(L, device="cuda").float() + 100
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
        emb = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
        cos, sin = (t.to(dtype).expand(B, L, D)[:, None] for t in (emb.cos(), emb.sin()))

        def eager(q=q, k=k, cos=cos, sin=sin):         # HF's apply_rotary_pos_emb
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

        compiled = _common.compiled(eager)

        def accelc_rope(q=q, k=k, cos=cos, sin=sin):
            return torch.ops.accelc.rotary_embedding(q, cos, sin), torch.ops.accelc.rotary_embedding(k, cos, sin)

        ref = eager(*(t.double() for t in (q, k, cos, sin)))
        row = {"shape": f"q {B}x{H}x{L}x{D}, k {Hkv} heads", "where": where, "dtype": str(dtype).replace("torch.", "")}
        moved = (2 * (q.numel() + k.numel()) + 2 * B * L * D) * q.element_size()
        rows.append(_common.measure_row(row, {"eager": eager, "compile": compiled, "accelc": accelc_rope}, ref, ROUNDS,
                                        moved=moved, label=f"{where:>32}"))
    return rows


def markdown(env, rows) -> str:
    table = []
    for r in rows:
        table.append([r["where"], r["shape"], r["eager"]["us"], r["compile"]["us"], r["accelc"]["us"],
                      _common.gbs_cell(env, r['accelc']['gbs']), f"{r['compile']['gbs']}", _common.ratio_cell(r["vs_eager"]),
                      _common.ratio_cell(r["vs_compile"]),
                      f"{r['rel_err']['accelc']:.1e} / {r['rel_err']['eager']:.1e}"])
    return (f"# Rotary embedding of q and k, HF's form, fp16 ({env['device']})\n\n{_common.env_line(env)}\n\n"
            "us: CUDA-graph median per call (q and k), median of rounds; GB/s: bytes the op must move (q, k read "
            "and written, cos / sin read) over the time (% of the device's HBM bandwidth); speedups: median "
            "(min-max) of per-round ratios; error: relative L2 vs fp64, accelc / eager.\n\n"
            + _common.md_table(["model", "shape", "eager us", "torch.compile us", "accelc us", "accelc GB/s",
                                "compile GB/s", "accelc vs eager", "accelc vs compile", "error accelc / eager"], table))


def main():
    _common.bench_main("rotary", rows_for, markdown)


if __name__ == "__main__":
    main()
