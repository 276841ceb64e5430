"""What ptxas makes of gemv_kernel's one-row candidates for sm90, built on a machine without a GPU
(bench/gluon_compile.py's stand-in driver, the ptxas and cuobjdump inside the triton wheel): per
candidate and weight dtype, the registers a thread and the instructions of the K loop (the region a
backward branch closes) by kind: global loads, shared-memory stores and loads, barriers,
conversions, FMAs. A loop with shared-memory traffic and barriers moves its operands between
layouts every K block; the flat candidates (gemm.gemv_row) are meant to have none.

    TRITON_INTERPRET=0 python bench/gemv_sass.py [--out bench/results]
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch
import triton

from gluon_compile import Sm90Driver, sass_and_usage   # (sets TRITON_INTERPRET=0 before accelc is imported)

KINDS = {"LDG": ("LDG",), "STS": ("STS",), "LDS": ("LDS", "LDSM"), "BAR": ("BAR",), "I2F": ("I2F",),
         "HADD2": ("HADD2",), "FFMA": ("FFMA",)}
_OP = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?P\w+\s+)?([A-Z][A-Z0-9_.]+)([^;]*);")


def loop_counts(sass_text: str) -> tuple[collections.Counter, int]:
    """Instruction kinds inside the longest loop (the code between a backward branch's target and
    the branch), and that loop's instruction count."""
    ops = [(int(m.group(1), 16), m.group(2).split(".")[0], m.group(3)) for m in _OP.finditer(sass_text)]
    best = (0, 0)
    for addr, op, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > best[1] - best[0]:
            best = (int(target.group(1), 16), addr)
    body = [op for addr, op, _ in ops if best[0] <= addr <= best[1]]
    return collections.Counter(body), len(body)


def build(cfg: triton.Config, wdtype, gated: bool, K: int = 4096, N: int = 4096, norm: bool = False) -> dict:
    from accelc.kernels import gemm

    kw = cfg.all_kwargs()
    x = torch.empty(1, K, dtype=torch.float16)
    w = torch.empty(N, K, dtype=wdtype)
    out = torch.empty(1, N // 2 if gated else N, dtype=torch.float16)
    scale = torch.empty(N, dtype=torch.float32)
    res = out
    compiled = gemm.gemv_kernel.warmup(
        x, w, None, res, out, scale, 1, N, K, out.shape[1], K, 1, K, 1, out.shape[1], 1, out.shape[1], 1,
        torch.empty(K, dtype=torch.float16), 1e-6, NORM=norm, HAS_BIAS=False, HAS_RESIDUAL=not gated, RESIDUAL_FIRST=False, ACTIVATION=0, FAST_MATH=False, GATED=gated,
        EVEN_K=K % kw["BLOCK_K"] == 0, W_SCALED=wdtype == torch.int8, BLOCK_M=1, BLOCK_N=kw["BLOCK_N"],
        BLOCK_K=kw["BLOCK_K"], FLAT=kw.get("FLAT", False), num_warps=kw["num_warps"], num_stages=1, grid=(1,))
    text, usage = sass_and_usage(compiled)
    counts, length = loop_counts(text)
    regs = re.search(r"REG:(\d+)", usage)
    return {"registers": int(regs.group(1)) if regs else None, "loop_instructions": length,
            **{k: sum(counts[o] for o in ops) for k, ops in KINDS.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="also write gemv_sass-sm90-triton<version>.md there")
    args = ap.parse_args()
    triton.runtime.driver.set_active(Sm90Driver())
    from accelc.kernels import gemm

    head = ["weight", "layer", "candidate", "registers", "loop instructions", *KINDS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for wdtype, configs in ((torch.float16, gemm.GEMV_CONFIGS), (torch.int8, gemm.GEMV_INT8_CONFIGS)):
        for cfg in configs:
            kw = cfg.kwargs
            if kw["BLOCK_M"] != 1:
                continue
            for gated, norm in ((False, False), (True, False), (False, True), (True, True)):
                if gated and kw["BLOCK_N"] < 2 * gemm.GATE_GROUP:
                    continue
                row = build(cfg, wdtype, gated, norm=norm)
                name = ("flat " if kw.get("FLAT") else "") + f"1x{kw['BLOCK_N']}x{kw['BLOCK_K']}, {cfg.num_warps} warps"
                layer = ("gated" if gated else "linear + residual") + (", RMSNorm before" if norm else "")
                cells = [str(wdtype).split(".")[-1], layer, name,
                         row["registers"], row["loop_instructions"], *(row[k] for k in KINDS)]
                lines.append("| " + " | ".join(str(c) for c in cells) + " |")
                print(lines[-1], flush=True)
    text = (f"# gemv_kernel's one-row candidates in SASS (sm90, triton {triton.__version__}, compiled without a GPU)\n\n"
            "K = N = 4096, fp16 x; counts of the K loop's instructions (the longest region a backward branch "
            "closes) by kind; LDS counts LDS and LDSM. 'RMSNorm before': the norm before the projection in the K loop "
            "(gemv_kernel's NORM).\n\n" + "\n".join(lines) + "\n")
    if args.out:
        path = Path(args.out) / f"gemv_sass-sm90-triton{triton.__version__}.md"
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
