"""The conv kernel's SASS for sm90, one file per gather path (taps, RECT, RECT split, taps split, FLAT_K,
ROWS), built on a machine without a GPU (bench/gluon_compile.py's stand-in driver) with the ptxas and
cuobjdump inside the triton wheel. Two checkouts' folders compared show whether a change to the
kernel's source changes the machine code (a restructuring that should not: same SASS, same speed).

    TRITON_INTERPRET=0 python bench/conv_sass.py OUT_DIR        # then: diff -r OUT_A OUT_B
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton

from gluon_compile import Sm90Driver   # (sets TRITON_INTERPRET=0 before accelc is imported)

# (name, config, N, C, H, W, K, R, S, stride, padding, dilation, ROWS path)
CASES = [("taps", "config(128, 128, 64, 3, 8)", 8, 64, 28, 28, 64, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1), False),
         ("rect", "rect_config(8, 16, 64, 64, 4, 4)", 8, 64, 28, 28, 64, 3, 3, (1, 1), (1, 1, 1, 1), (1, 1), False),
         ("rect_split", "rect_config(8, 8, 64, 64, 4, 4, split=4)", 1, 512, 7, 7, 512, 3, 3, (1, 1), (1, 1, 1, 1),
          (1, 1), False),
         ("taps_split", "config(64, 64, 64, 4, 4, split=2)", 1, 256, 14, 14, 256, 3, 3, (2, 2), (1, 1, 1, 1), (1, 1),
          False),
         ("flat_k", "config(128, 64, 32, 4, 4)", 4, 8, 32, 32, 32, 3, 3, (1, 1), (2, 2, 2, 2), (1, 2), False),
         ("rows", "ROWS_CONFIGS[0]", 4, 3, 64, 64, 64, 7, 7, (2, 2), (3, 3, 3, 3), (1, 1), True)]


def sass(name, cfg, N, C, H, W, K, R, S, stride, padding, dilation, rows) -> str:
    from accelc.kernels import conv
    from accelc.kernels.epilogue import activation_code

    h = torch.float16
    x = torch.empty(N, C, H, W, dtype=h).contiguous(memory_format=torch.channels_last)
    w = conv.pack_weight(torch.empty(K, C, R, S, dtype=h))
    OH, OW = conv.output_size(H, W, R, S, stride, padding, dilation)
    out = torch.empty((N, K, OH, OW), dtype=h, memory_format=torch.channels_last)
    bias = torch.empty(K, dtype=h)
    geo = conv.rows_geometry(x, w, stride, dilation, (OH, OW)) if rows else None
    cp, sp, hp, wp, align = geo or (0, 0, 0, 0, 0)
    tensors = ((torch.empty((N, hp, wp, cp), dtype=h).permute(0, 3, 1, 2), torch.empty((K, R, sp, cp), dtype=h),
                bias, out, out) if geo else (x, w, bias, out, out))
    meta = dict(HAS_BIAS=True, HAS_RESIDUAL=False, RESIDUAL_FIRST=False, ACTIVATION=activation_code("relu"), S=S,
                TAPS=R * S, FLAT_K=C < 16 and geo is None, ROW_CP=cp, ROW_SP=sp, ROW_ALIGN=align,
                INPUT_PRECISION="ieee", DOT_IN_FP32=False)
    kw = eval(f"conv.{cfg}").all_kwargs()
    part = torch.empty((kw["SPLIT"], N * OH * OW, K), dtype=torch.float32) if kw["SPLIT"] > 1 else None
    compiled = conv._conv_kernel.warmup(*conv._args(kw, tensors, stride, padding, dilation, part), **meta, **kw,
                                        grid=(1,))
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    # instruction addresses and the file name are not the code
    return "\n".join(re.sub(r"/\*[0-9a-f]{4}\*/", "", line) for line in text.splitlines()
                     if "code for" not in line and ".cubin" not in line)


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "conv-sass")
    out.mkdir(parents=True, exist_ok=True)
    triton.runtime.driver.set_active(Sm90Driver())
    for case in CASES:
        text = sass(*case)
        (out / f"{case[0]}.sass").write_text(text)
        print(case[0], sum(1 for line in text.splitlines() if re.search(r"^\s+[A-Z@]", line)), "lines of SASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
