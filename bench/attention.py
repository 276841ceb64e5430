"""FlashAttention forward, fp16, on the GPU: accelc::flash_attention against
F.scaled_dot_product_attention with the FLASH_ATTENTION and CUDNN_ATTENTION backends, and the naive
eager form softmax(q @ k^T * scale) @ v.

    python bench/attention.py [--out bench/results]

Timed like bench/gemm.py: CUDA-graph medians in interleaved rounds, speedups as medians of
per-round ratios. FLOPs counted as 4*B*H*S*S*D (halved for causal).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402,F401
from accelc.kernels import flash_attention as fa  # noqa: E402

CASES = [  # (B, H, S, D, causal)
    (8, 16, 1024, 64, False), (8, 16, 1024, 64, True),
    (4, 16, 4096, 64, False), (4, 16, 4096, 64, True),
    (4, 16, 4096, 128, False), (4, 16, 4096, 128, True),
    (32, 12, 197, 64, False),
]
ROUNDS = 5
F = torch.nn.functional


def sdpa_with(backend, q, k, v, causal):
    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fn


def naive(q, k, v, causal):
    scale = q.shape[-1] ** -0.5
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril() if causal else None

    def fn():
        s = q @ k.transpose(-2, -1) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v
    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    env = _common.environment()
    print(_common.env_line(env))
    rows = []
    for B, H, S, D, causal in CASES:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.float16) for _ in range(3))
        variants = {
            "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION, q, k, v, causal),
            "sdpa_cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION, q, k, v, causal),
            "naive_eager": naive(q, k, v, causal),
            "accelc": lambda: torch.ops.accelc.flash_attention(q, k, v, None, causal),
        }
        ref = fa.flash_attention_ref(q, k, v, None, causal)
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        row = dict(B=B, H=H, S=S, D=D, causal=causal)
        for name, fn in list(variants.items()):
            try:
                out = fn()
                torch.cuda.synchronize()
            except Exception as e:  # a backend that does not take this case
                print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                del variants[name]
                continue
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            row[name] = {"rel_l2_vs_fp32": float(f"{err:.2e}")}
        _common.time_rounds(variants, row, ROUNDS, flops)
        for base in ("sdpa_flash", "sdpa_cudnn", "naive_eager"):
            if base in variants:
                row[f"speedup_vs_{base}"] = _common.speedup(row, "accelc", base)[0]
        print(f"  {B}x{H}x{S}x{D} causal={causal}: " + ", ".join(
            f"{n} {row[n]['us']:.0f} us {row[n]['tflops']:.0f} TF/s" for n in variants), flush=True)
        rows.append(row)

    def cell(r, n):
        return f"{r[n]['us']:.1f} us, {r[n]['tflops']:.0f} TF/s" if n in r else "n/a"

    header = ["B, H, S, D", "causal", "SDPA flash", "SDPA cuDNN", "naive eager", "accelc",
              "accelc / SDPA flash", "accelc / cuDNN", "accelc / naive"]
    table = [[f"{r['B']}, {r['H']}, {r['S']}, {r['D']}", r["causal"], cell(r, "sdpa_flash"), cell(r, "sdpa_cudnn"),
              cell(r, "naive_eager"), cell(r, "accelc")]
             + [f"{r[f'speedup_vs_{b}']:.2f}x" if f"speedup_vs_{b}" in r else "n/a"
                for b in ("sdpa_flash", "sdpa_cudnn", "naive_eager")] for r in rows]
    md = (f"# accelc::flash_attention forward, fp16\n\n{_common.env_line(env)}\n\n"
          f"Median over captured CUDA graphs, {ROUNDS} interleaved rounds; speedup = other / accelc, median "
          "of per-round ratios (> 1: accelc faster). FLOPs 4*B*H*S*S*D, halved when causal.\n\n"
          + _common.md_table(header, table))
    _common.write(args.out, "attention", env, rows, md)
    print()
    print(md)


if __name__ == "__main__":
    main()
