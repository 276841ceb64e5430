"""The tl FlashAttention kernel's candidates built for sm90 on a machine without a GPU (bench/gluon_compile.py's
stand-in driver, the ptxas inside the triton wheel), fp16 and fp8 (Fp8Config(attention=True): both products on
e4m3 operands, q, K and V read as e4m3 copies): registers, spill stores, and the wgmma instructions by kind (HGMMA fp16, QGMMA fp8). Whether the
fp8 products reach fp8 tensor cores, and at what register cost, before any device time.

    TRITON_INTERPRET=0 python bench/flash_fp8_build.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch
import triton

from gluon_compile import Sm90Driver, sass_and_usage   # (sets TRITON_INTERPRET=0 before accelc is imported)


def build(cfg: triton.Config, D: int, causal: bool, fp8: bool) -> dict:
    from accelc.kernels import flash_attention as fa

    kw = cfg.all_kwargs()
    B, H, L, S = 2, 8, 1024, 1024
    q, k, v, out = (torch.empty(B, H, n, D, dtype=torch.float16) for n in (L, S, S, L))
    scales = (torch.empty(B, H, L), torch.empty(B, H, S), torch.empty(B, H, D))
    if fp8:   # the e4m3 copies the kernel reads (kernels/attention_fp8.py): V with its keys contiguous
        q, k = (t.to(torch.float8_e4m3fn) for t in (q, k))
        v = torch.empty(B, H, D, S, dtype=torch.float8_e4m3fn).transpose(2, 3)
    compiled = fa._flash_fwd_kernel.warmup(
        q, k, v, q, out, *scales, q, k, v, H, 1, L, S, 0.125, *q.stride(), *k.stride(), *v.stride(), 0, 0, 0, 0,
        *out.stride(),
        HEAD_DIM=D, BLOCK_D=D, MASK_KIND=0, MASK_ROW=False, IS_CAUSAL=causal, FMA_SOFTMAX=True, DOT_IN_FP32=False,
        QK_INT8=False, USE_LIBDEVICE=True, EMPTY_NAN=False, INPUT_PRECISION="ieee", FP8=fp8,
        BLOCK_M=kw["BLOCK_M"], BLOCK_N=kw["BLOCK_N"], TMA=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        grid=(1,))
    sass, usage = sass_and_usage(compiled)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"block": f"{kw['BLOCK_M']}x{kw['BLOCK_N']}", "warps": cfg.num_warps, "stages": cfg.num_stages, "D": D,
            "causal": causal, "fp8": fp8, "registers": int(regs.group(1)) if regs else None,
            "stack_bytes": int(regs.group(2)) if regs else None, "spill_stores": sass.count("STL"),
            "hgmma": sass.count("HGMMA"), "qgmma": sass.count("QGMMA")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    triton.runtime.driver.set_active(Sm90Driver())
    from accelc.kernels import flash_attention as fa

    rows = []
    for cfg in [c for c in fa.CONFIGS if not c.kwargs["TMA"]][:5]:
        for D in (64, 128):
            for fp8 in (False, True):
                try:
                    row = build(cfg, D, False, fp8)
                except Exception as e:    # a candidate this Triton cannot build: said in its row
                    row = {"block": f"{cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']}", "D": D, "fp8": fp8,
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / f"flash_fp8_build-sm90-triton{triton.__version__}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
