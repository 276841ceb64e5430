"""Tuning aid for kernels/gemm.py: time explicit configs and load/store paths per shape,
bypassing the autotuner, to choose the candidate list in CONFIGS.

    python bench/gemm_sweep.py [--out DIR] [--int8]

--int8: kernels/int8_gemm.py's candidates (and a few more) on int8 operands, fp16 out.

path "tma": TMA loads (persistent grid, PROGRAMS_PER_SM programs per SM);
     "ptr": pointer loads, one program per tile
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _common  # noqa: E402

import accelc  # noqa: E402,F401
from accelc.kernels import gemm, int8_gemm  # noqa: E402
from accelc.kernels.int8_gemm import quantize_weight  # noqa: E402
from accelc.kernels.quantize import quantize_launch  # noqa: E402
from accelc.latency import median_ms  # noqa: E402

C = gemm.config
# every config of kernels/gemm.py's candidate list, at every shape
SHAPES = [(4096, 4096, 16384), (512, 4096, 4096), (16, 4096, 4096)]
CANDIDATES = {shape: gemm.CONFIGS for shape in SHAPES}
INT8_EXTRA = [C(128, 256, 128, 4, 8, tma=False), C(256, 128, 128, 3, 8), C(256, 128, 128, 3, 8, ws=True),
              C(128, 256, 64, 4, 8), C(128, 128, 128, 5, 8), C(128, 256, 128, 3, 8, flatten=False),
              C(64, 256, 128, 4, 4, tma=False), C(32, 128, 256, 4, 4, tma=False)]
INT8_CANDIDATES = {shape: int8_gemm.CONFIGS + INT8_EXTRA for shape in SHAPES}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--int8", action="store_true")
    args = ap.parse_args()
    env = _common.environment()
    print(_common.env_line(env))
    results = []
    for (M, K, N), configs in (INT8_CANDIDATES if args.int8 else CANDIDATES).items():
        x = torch.randn(M, K, device="cuda", dtype=torch.float16)
        w = (torch.randn(N, K, device="cuda") / K**0.5).half()
        b = torch.randn(N, device="cuda", dtype=torch.float16)
        out = torch.empty(M, N, device="cuda", dtype=torch.float16)
        ref = gemm.linear_ref(x.float(), w.float(), b.float(), activation="gelu")
        scales = None
        if args.int8:   # the GEMM alone: x quantized beforehand, as the layer's first kernel does
            (x, a_s), (w, w_s) = quantize_launch(x), quantize_weight(w)
            scales = (a_s, w_s)
        best = None
        for cfg in configs:
            if cfg.kwargs["BLOCK_M"] > max(16, M):
                continue  # taller than M: the autotuner prunes these too
            path = "tma" if cfg.kwargs["USE_TMA"] else "ptr"

            def fn():
                gemm.launch(x, w, b, None, out, "gelu", config=cfg, scales=scales)
            try:
                fn()
                torch.cuda.synchronize()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                us = median_ms(fn, cuda_graph=True) * 1e3
            except Exception as e:  # out of shared memory etc.: recorded, the sweep goes on
                print(f"  {M}x{K}x{N} {path} {cfg}: {type(e).__name__}")
                continue
            tf = 2 * M * N * K / us / 1e6
            results.append(dict(M=M, K=K, N=N, path=path, config=str(cfg), us=round(us, 2),
                                tflops=round(tf, 1), err=err))
            print(f"  {M}x{K}x{N} {path} {us:8.1f} us {tf:6.1f} TF/s err {err:.1e}  "
                  f"{cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}", flush=True)
            if best is None or us < best[0]:
                best = (us, cfg)
        us, cfg = best
        epilogues = {}
        for act in ("none", "relu", "gelu", "gelu_tanh"):
            def fn():
                gemm.launch(x, w, b, None, out, act, config=cfg, scales=scales)
            epilogues[act] = median_ms(fn, cuda_graph=True) * 1e3
        print(f"  {M}x{K}x{N} best {us:.1f} us {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}; "
              "same config by activation: " + ", ".join(f"{a} {t:.1f}" for a, t in epilogues.items()))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"gemm_sweep{'_int8' if args.int8 else ''}.json").write_text(json.dumps({"environment": env, "rows": results}))


if __name__ == "__main__":
    main()
