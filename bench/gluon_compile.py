"""Compile the Gluon kernels' candidates (the GEMM's, or with --kernel attention the attention kernel's)
for sm90 on a machine without a GPU, and read what ptxas made of them: registers, stack (spills),
shared memory, and the count of wgmma (HGMMA) instructions in the SASS.

    TRITON_INTERPRET=0 python bench/gluon_compile.py [--kernel gemm|w8a8|fp8|conv|attention|attention_fp8] [--configs 0,1] [--json]

Triton compiles for the target its active driver names; a stand-in driver that names sm90 lets the
whole pipeline (Gluon -> TTGIR -> LLVM -> PTX -> ptxas -> cubin) run here, with the ptxas and cuobjdump
that ship inside the triton wheel. What cannot be known without the GPU: whether it runs, and how
fast. Used to catch a kernel the installed Triton cannot build (tests/test_gemm_hopper.py runs it in a
subprocess) and to read spills before spending device time (kernels/epilogue.py's GELU_FIT: libdevice's
erf spilled 736 bytes a thread in the 4-warp consumers, the branch-free fit nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"      # before accelc: kernels compile, they are not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


class Sm90Driver:
    """The parts of Triton's active driver that compiling (not launching) asks for."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


# (epilogue, residual, weight stored (K, N)) per case: what each candidate is built with
CASES = [("gelu", True, False), ("gelu_tanh", False, True)]


def compile_candidate(index: int, activation: str, residual: bool, w_t: bool, dtype=torch.float16,
                      quant: int = 0) -> dict:
    """One GEMM candidate (quant 1: int8_gemm's Gluon candidates, W8A8 with int8 x and weight, fp16 out; 2: the
    same with fp8 (e4m3) x and weight)."""
    from accelc.kernels import gemm, gemm_hopper, int8_gemm
    from accelc.kernels.epilogue import activation_code

    kw = (int8_gemm.GLUON_CONFIGS if quant else gemm.GLUON_CONFIGS)[index].all_kwargs()
    M, N, K = 4096, 4096, 4096
    op = {1: torch.int8, 2: torch.float8_e4m3fn}.get(quant, dtype)
    x = torch.empty(M, K, dtype=op)
    w = torch.empty(K, N, dtype=op).t() if w_t else torch.empty(N, K, dtype=op)
    out = torch.empty(M, N, dtype=dtype)
    res = torch.empty(M, N, dtype=dtype) if residual else None
    scale = torch.empty(M, dtype=torch.float32)
    if kw.get("COOP"):
        descs = gemm_hopper.coop_descriptors(x, w, res, out, kw["BN1"], kw["BN2"], kw["BLOCK_K"], w_t)
        compiled = gemm_hopper.linear_coop_kernel.warmup(
            *descs, torch.empty(N, dtype=dtype), M, N, K, True, residual, False, activation_code(activation), w_t,
            kw["BN2"], kw["WGS"], kw["STAGES"], kw["GROUP_M"], kw["LOAD_REGS"], kw["MMA_REGS"],
            num_warps=kw["num_warps"], maxnreg=kw.get("maxnreg"), grid=(132,))
        return {"config": index, "activation": activation, "residual": residual, "w_t": w_t, "dtype": str(dtype),
                **_usage(compiled)}
    descs = gemm_hopper.descriptors(x, w, res, out, kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], w_t)
    compiled = gemm_hopper.linear_ws_kernel.warmup(
        *descs, torch.empty(N, dtype=dtype), scale, scale, M, N, K, True, residual, False, activation_code(activation),
        quant, w_t, kw["STAGES"], kw["GROUP_M"], kw["CONSUMERS"], 40, 232, num_warps=kw["num_warps"],
        maxnreg=kw.get("maxnreg"), grid=(132,))
    return {"config": index, "activation": activation, "residual": residual, "w_t": w_t,
            "dtype": f"{str(op).removeprefix('torch.')} -> {dtype}" if quant else str(dtype), **_usage(compiled)}


def compile_conv(index: int, activation: str, residual: bool, stride: int = 1, dtype=torch.float16) -> dict:
    """One Gluon conv candidate (kernels/conv_hopper.py) on ResNet-50's first 3x3 conv at batch 32 (stride 2:
    layer2.0's, 56 x 56 in, 28 x 28 out)."""
    from accelc.kernels import conv, conv_hopper
    from accelc.kernels.epilogue import activation_code

    kw = conv.GLUON_CONFIGS[index].all_kwargs()
    N, H, W, C, K = (32, 56, 56, 64, 64) if stride == 1 else (32, 56, 56, 128, 128)
    x, out = torch.empty(N, H, W, C, dtype=dtype), torch.empty(N, H // stride, W // stride, K, dtype=dtype)
    descs = conv_hopper.descriptors(x, torch.empty(K, 9 * C, dtype=dtype), torch.empty_like(out) if residual else None,
                                    out, kw["BLOCK_H"], kw["BLOCK_W"], kw["BLOCK_N"], kw["BLOCK_K"], stride)
    compiled = conv_hopper.conv_ws_kernel.warmup(
        *descs, torch.empty(K, dtype=dtype), N, *out.shape[1:3], K, C, 3, 3, 1, 1, 1, 1, True, residual, True,
        activation_code(activation), kw["STAGES"], kw["GROUP_M"], kw["CONSUMERS"], 40, 232, stride,
        num_warps=kw["num_warps"], maxnreg=kw.get("maxnreg"), grid=(132,))
    return {"config": index, "activation": activation, "residual": residual, "stride": stride, "dtype": str(dtype),
            **_usage(compiled)}


# attention cases: (head dim, mask kind (0 none, 1 additive, 2 boolean), mask one row for every query
# (a key padding mask), causal)
ATTENTION_CASES = [(128, 0, False, False), (64, 1, True, False), (128, 2, False, True), (64, 0, False, True)]
# fp8 (Fp8Config(attention=True)): e4m3 operands, the kernel's FP8 path
ATTENTION_FP8_CASES = [(128, 0, False, False, torch.float16, True), (64, 2, False, True, torch.float16, True)]


def sass_and_usage(compiled) -> tuple[str, str]:
    """A compiled kernel's SASS and its resource usage (registers, stack), as cuobjdump prints them."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    return sass, usage


def _usage(compiled) -> dict:
    sass, usage = sass_and_usage(compiled)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"registers": int(found.group(1)) if found else None, "stack_bytes": int(found.group(2)) if found else None,
            "shared_bytes": compiled.metadata.shared, "hgmma": sass.count("HGMMA") + sass.count("IGMMA") + sass.count("QGMMA"),
            "qgmma": sass.count("QGMMA"), "spill_stores": sass.count("STL")}


def compile_attention(index: int, head_dim: int, mask_kind: int, mask_row: bool, causal: bool,
                      dtype=torch.float16, fp8: bool = False) -> dict:
    """One attention candidate built for (B, S, H, D) memory viewed as (B, H, S, D), as the head split gives it;
    fp8: on the e4m3 copies kernels/attention_fp8.py makes (V keys-contiguous)."""
    from accelc.kernels import flash_attention
    from accelc.kernels import attention_hopper as ah

    kw = flash_attention.GLUON_CONFIGS[index].all_kwargs()
    B, H, L = 2, 4, 1024
    q, k, v, out = (torch.empty(B, L, H, head_dim, dtype=dtype).transpose(1, 2) for _ in range(4))
    scales = (q, q, q)
    if fp8:
        q, k = (torch.empty(B, H, L, head_dim, dtype=torch.float8_e4m3fn) for _ in range(2))
        v = torch.empty(B, H, head_dim, L, dtype=torch.float8_e4m3fn).transpose(2, 3)
        scales = (torch.empty(B, H, L), torch.empty(B, H, L), torch.empty(B, H, head_dim))
    mask = out
    if mask_kind:
        mask = torch.empty((B, 1, 1, L) if mask_row else (B, 1, L, L), dtype=dtype if mask_kind == 1 else torch.bool)
        mask = mask.expand(B, H, L, L)
    compiled = ah.attention_ws_kernel.warmup(
        *ah.descriptors(q, k, v, kw["BLOCK_N"]), out, mask, *scales, H, 1, L, L, 0.18, *out.stride()[:3],
        *(mask.stride() if mask_kind else (0, 0, 0, 0)), mask_kind, mask_row, causal, False, kw["STAGES"],
        kw["PINGPONG"], mask_kind == 0 and not fp8, kw["CONSUMERS"], kw["SOFTMAX_REGS"], kw["LOAD_REGS"], fp8,
        num_warps=kw["num_warps"], maxnreg=kw["maxnreg"], grid=(8, B * H))
    return {"config": index, "head_dim": head_dim, "mask_kind": mask_kind, "mask_row": mask_row, "causal": causal,
            "dtype": "fp8" if fp8 else str(dtype), **_usage(compiled)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("gemm", "w8a8", "fp8", "conv", "attention", "attention_fp8"), default="gemm")
    ap.add_argument("--configs", default="", help="indices into the kernel's GLUON_CONFIGS (default: all)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args()
    triton.runtime.driver.set_active(Sm90Driver())
    from accelc.kernels import conv, flash_attention, gemm, int8_gemm

    owner = {"attention": flash_attention, "attention_fp8": flash_attention, "conv": conv}.get(args.kernel, gemm)
    module, reason = owner._hopper_import()
    if module is None:
        print(json.dumps({"error": reason}) if args.json else reason)
        return 1
    configs = int8_gemm.GLUON_CONFIGS if args.kernel in ("w8a8", "fp8") else owner.GLUON_CONFIGS
    indices = [int(i) for i in args.configs.split(",")] if args.configs else range(len(configs))
    if args.kernel == "gemm":
        jobs = [(i, case, compile_candidate) for i in indices for case in CASES]
    elif args.kernel == "conv":
        cases = (("relu", True), ("none", False), ("relu", True, 2))   # the last at stride 2
        jobs = [(i, case, compile_conv) for i in indices for case in cases]
    elif args.kernel in ("w8a8", "fp8"):   # one-byte weights are stored (N, K): their MMA reads both operands K-major
        quant = 1 if args.kernel == "w8a8" else 2
        jobs = [(i, (act, res, False, torch.float16, quant), compile_candidate)
                for i in indices for act, res in (("gelu", True), ("none", False))]
    else:
        cases = ATTENTION_FP8_CASES if args.kernel == "attention_fp8" else ATTENTION_CASES
        jobs = [(i, case, compile_attention) for i in indices for case in cases]
    failed = 0
    for i, case, build in jobs:
        try:
            row = build(i, *case)
        except Exception as e:   # a build failure is the answer here
            row = {"config": i, "case": str(case), "error": f"{type(e).__name__}: {str(e)[-300:]}"}
            failed += 1
        print(json.dumps(row) if args.json else row, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
