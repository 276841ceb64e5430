"""Nsight Compute evidence for the attention kernels at one shape: the Gluon candidates (forced), the
fastest tl candidate (forced) and cuDNN's SDPA, one launch each between cudaProfilerStart / Stop.

    ncu --profile-from-start off --clock-control none --csv --log-file ncu.csv --metrics M \\
        python bench/ncu_attention.py [B,H,L,D[,causal]]

Launch order (the CSV's IDs): every kernels.flash_attention.GLUON_CONFIGS entry in order, then the tl
config named by --tl, then cuDNN SDPA.
"""
import argparse

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from accelc.kernels import flash_attention as fa


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="4,16,4096,128")
    ap.add_argument("--tl", default="128,128,3,8", help="BLOCK_M,BLOCK_N,stages,warps of the tl TMA config")
    args = ap.parse_args()
    parts = args.shape.split(",")
    B, H, L, D = map(int, parts[:4])
    causal = len(parts) > 4 and parts[4] == "causal"
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.float16) for _ in range(3))
    bm, bn, st, w = map(int, args.tl.split(","))
    runs = [(f"gluon {c.kwargs}", c) for c in fa.GLUON_CONFIGS]
    runs.append((f"tl {args.tl}", fa.config(bm, bn, st, w, tma=True)))
    calls = []
    for name, cfg in runs:
        with fa.TUNER.force(cfg):
            fa.flash_attention(q, k, v, None, causal)     # compiled and warm
            calls.append((name, dict(fa.TUNER.calls)))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, table in calls:
        saved, fa.TUNER.calls = fa.TUNER.calls, table
        fa.flash_attention(q, k, v, None, causal)
        fa.TUNER.calls = saved
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    for i, (name, _) in enumerate(calls):
        print(i, name)
    print(len(calls), "cuDNN SDPA", triton.__version__)


if __name__ == "__main__":
    main()
