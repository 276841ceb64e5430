"""Compile accelc::linear_fp8's tl candidates (linear_kernel with QUANT=4: e4m3 x and weight, fp16 out, bias and
GELU) and the rows' quantization kernel for sm90 on a machine without a GPU (the stand-in driver of
bench/gluon_compile.py), and count the fp8 wgmma (QGMMA) instructions in each SASS: what the installed Triton
makes of them before any device time is spent. Whether they run, and how fast, needs the GPU.

    python bench/fp8_compile.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"      # before accelc: kernels compile, they are not interpreted
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import triton  # noqa: E402
from gluon_compile import Sm90Driver, sass_and_usage  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    triton.runtime.driver.set_active(Sm90Driver())
    from accelc.kernels import fp8_gemm, gemm
    from accelc.kernels.epilogue import activation_code

    M, N, K = 512, 1024, 1024
    x = torch.empty(M, K, dtype=torch.float8_e4m3fn)
    w = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    out, bias = torch.empty(M, N, dtype=torch.float16), torch.empty(N, dtype=torch.float16)
    a_scale, w_scale = torch.empty(M), torch.empty(N)
    rows = []
    # linear_fp8 (GELU epilogue) and gated_linear_fp8 (SiLU(gate) * up): the same candidates
    for gated, (i, cfg) in [(g, c) for g in (False, True) for c in enumerate(fp8_gemm.CONFIGS)]:
        kw = cfg.all_kwargs()
        if kw.get("GLUON"):     # (the Gluon candidates: bench/gluon_compile.py --kernel fp8; none gated)
            continue
        meta = dict(HAS_BIAS=True, HAS_RESIDUAL=False, RESIDUAL_FIRST=False,
                    ACTIVATION=activation_code("silu" if gated else "gelu"), QUANT=4, GATED=gated, W_T=False,
                    FAST_MATH=False, INPUT_PRECISION="ieee", DOT_IN_FP32=False)
        row = {"config": i, "gated": gated, **{k: kw[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "USE_TMA")}}
        try:
            compiled = gemm.linear_kernel.warmup(*gemm.kernel_args(kw, (x, w, bias, out, out, a_scale, w_scale)),
                                                 **meta, EVEN_K=True, **kw, grid=(1,))
            sass, usage = sass_and_usage(compiled)
            found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
            row.update(built=True, qgmma=sass.count("QGMMA"), hgmma=sass.count("HGMMA"),
                       registers=int(found.group(1)) if found else None, stack_bytes=int(found.group(2)) if found else None)
        except Exception as e:     # what this Triton cannot build, said in its row
            row.update(built=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    # the row held in registers (K up to ONE_PASS_MAX_K), with and without the RMSNorm before it; or read twice
    for one_pass, norm in ((True, False), (True, True), (False, False)):
        block = triton.next_power_of_2(K) if one_pass else fp8_gemm.TWO_PASS_BLOCK
        compiled = fp8_gemm._quantize_rows_kernel.warmup(torch.empty(M, K, dtype=torch.float16), x, a_scale, K, K, 1,
                                                         torch.empty(K, dtype=torch.float16), 1e-6,
                                                         ROUND_BY_HAND=False, BLOCK_K=block, ONE_PASS=one_pass,
                                                         NORM=norm, num_warps=8 if block >= 4096 else 4, grid=(M,))
        sass, usage = sass_and_usage(compiled)
        found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
        rows.append({"kernel": "quantize_rows", "one_pass": one_pass, "norm": norm, "block_k": block, "built": True,
                     "f2fp_conversions": sass.count("F2FP"), "registers": int(found.group(1)) if found else None,
                     "stack_bytes": int(found.group(2)) if found else None})
        print(json.dumps(rows[-1]))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        Path(a.out, "fp8_compile-sm90.json").write_text(json.dumps(
            {"environment": {"triton": triton.__version__, "torch": torch.__version__, "target": "sm90 (stand-in driver)"},
             "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
