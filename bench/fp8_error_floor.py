"""The error FP8 (e4m3) adds by its format alone, against fp16's, computed on the CPU (numerics, no timing): what
#61's accuracy target (a whole model's error within 3x fp16's against fp32) asks of any layer in fp8.

Each row: one linear layer y = x W^T on random inputs (x ~ N(0, 1), W ~ N(0, 1/K)), its output's relative L2 error
against the same product in fp64, for
  fp16        x and W rounded to fp16, the product accumulated in fp32, rounded to fp16 (a tensor core's GEMM);
  fp8 w+a     x with one scale a row (amax / 448), W with one a output channel, both rounded to e4m3, rounded to
              fp16 after (accelc::linear_fp8's reference, kernels/fp8_gemm.py);
  fp8 weights W alone in e4m3, x in fp16 (accelc::linear_fp8w's reference, kernels/fp8_weight.py);
  int8 w+a    the same scales at 127, rounded to int8 (accelc::linear_w8a8's reference, kernels/int8_gemm.py;
              for comparison).
Then a stack of DEPTH residual blocks (h = h + relu(h W1^T) W2^T, K wide), each side's arithmetic in every block:
the whole output's error against fp64, each side's over fp16's. e4m3's rounding is round-to-nearest-even on the
CPU as on the GPU, so the figures are the format's, not a machine's.

    python bench/fp8_error_floor.py [--out bench/results]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import accelc  # noqa: F401  (registers the kernels' modules)
from accelc.kernels import fp8_gemm, fp8_weight, int8_gemm

SIDES = ("fp16", "fp8 w+a", "fp8 weights", "int8 w+a")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def linear(x: torch.Tensor, w: torch.Tensor, side: str) -> torch.Tensor:
    """y = x w^T in the side's arithmetic (see the module docstring; the quantized sides are accelc's own
    references), fp32 out of an fp16 rounding."""
    if side == "fp8 w+a":
        return fp8_gemm.linear_fp8_ref(x.half(), *fp8_weight.quantize_weight(w.half())).float()
    if side == "fp8 weights":
        return fp8_weight.linear_fp8w_ref(x.half(), *fp8_weight.quantize_weight(w.half())).float()
    if side == "int8 w+a":
        return int8_gemm.linear_w8a8_ref(x.half(), *int8_gemm.quantize_weight(w.half())).float()
    return (x.half().float() @ w.half().float().T).half().float()


def one_layer(k: int, m: int = 512, n: int = 1024, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    ref = x.double() @ w.double().T
    return {side: _rel(linear(x, w, side), ref) for side in SIDES}


def stack(k: int, depth: int, m: int = 256, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    ws = [(torch.randn(2 * k, k, generator=g) / k ** 0.5, torch.randn(k, 2 * k, generator=g) / (2 * k) ** 0.5)
          for _ in range(depth)]
    ref = x.double()
    for w1, w2 in ws:
        ref = ref + torch.relu(ref @ w1.double().T) @ w2.double().T
    out = {}
    for side in SIDES:
        h = x.half().float()
        for w1, w2 in ws:
            h = (h + linear(torch.relu(linear(h, w1, side)), w2, side)).half().float()
        out[side] = _rel(h, ref)
    return out


def table() -> str:
    lines = ["# The error FP8 (e4m3) adds by its format, against fp16's (CPU numerics: `bench/fp8_error_floor.py`)", "",
             f"torch {torch.__version__}; see the script's docstring for each side's arithmetic. Relative L2 error "
             "against fp64; in brackets, over fp16's.", "",
             "One linear layer, 512 rows x K -> 1024:", "",
             "| K | " + " | ".join(SIDES) + " |", "|---|" + "---|" * len(SIDES)]
    for k in (768, 1536, 4096):
        e = one_layer(k)
        lines.append(f"| {k} | " + " | ".join(f"{e[s]:.2e}" + ("" if s == "fp16" else f" ({e[s] / e['fp16']:.0f}x)")
                                              for s in SIDES) + " |")
    lines += ["", "A stack of residual MLP blocks (K 768, 256 rows), every block in the side's arithmetic:", "",
              "| blocks | " + " | ".join(SIDES) + " |", "|---|" + "---|" * len(SIDES)]
    for depth in (1, 4, 12):
        e = stack(768, depth)
        lines.append(f"| {depth} | " + " | ".join(f"{e[s]:.2e}" + ("" if s == "fp16" else f" ({e[s] / e['fp16']:.0f}x)")
                                                  for s in SIDES) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="a folder: writes fp8_error_floor-cpu.md there (else prints)")
    args = ap.parse_args()
    text = table()
    if args.out:
        path = Path(args.out) / "fp8_error_floor-cpu.md"
        path.write_text(text)
        print(path)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
